"""The import graph of ``serving/``: no circle, counting imports inside functions too (a lazy
import hides a circle from Python, not from the reader); its boxes import only downward; and
the plain-Python core imports no jax."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The boxes of serving/, lowest first: a module may import its own box and those below it.
BOXES = ("core", "worker", "engine", "entrypoints")


def modules(package: str) -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of ``package``, its sub-packages' included (a
    package's ``__init__.py`` under the package's own name)."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, anywhere in its file. ``from a.b import
    c`` counts ``a.b.c`` where that is a module, else ``a.b``."""
    mods = modules(package)
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = (deps & set(mods)) - {name}
    return graph


def box(module: str) -> str | None:
    """The box (``serving.<box>``) a module of ``serving`` sits in; None for ``serving``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in BOXES else None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_serving_has_no_import_circle():
    graph = import_graph("serving")
    assert "serving.core.scheduler" in graph["serving.engine.llm_engine"]  # the graph is read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_boxes_import_only_downward():
    graph = import_graph("serving")
    loose = [m for m in graph if m != "serving" and box(m) is None]
    assert not loose, f"{loose} sit in no box of serving/ ({BOXES})"
    rank = {b: i for i, b in enumerate(BOXES)}
    up = [
        f"{m} -> {dep}"
        for m, deps in graph.items()
        for dep in deps
        if box(m) and box(dep) and rank[box(m)] < rank[box(dep)]
    ]
    assert not up, up


def test_the_core_never_imports_jax():
    """Imported in a fresh interpreter, the modules of ``serving.core`` pull in no jax, jaxlib
    or flax."""
    import subprocess
    import sys

    core = sorted(m for m in modules("serving") if box(m) == "core")
    assert {"serving.core", "serving.core.scheduler", "serving.core.plan"} <= set(core)
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in core)
        + "heavy = ('jax', 'jaxlib', 'flax')\n"
        + "bad = [m for m in sys.modules if m.split('.')[0] in heavy]\n"
        + "assert not bad, bad[:5]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]

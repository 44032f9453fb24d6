"""The import graph of ``serving/`` has no circle, counting imports inside functions too (a
lazy import hides a circle from Python, not from the reader)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, anywhere in its file."""
    mods = {p.stem: p for p in (ROOT / package).glob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                head, _, rest = node.module.partition(".")
                if head == package:
                    deps |= {rest.split(".")[0]} if rest else {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    head, _, rest = a.name.partition(".")
                    if head == package and rest:
                        deps.add(rest.split(".")[0])
        graph[name] = (deps & set(mods)) - {name}
    return graph


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
    assert {"engine", "runner", "multihost", "cli"} <= set(graph)
    assert "runner" in graph["engine"]  # the graph is read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


# The plain-Python core of DESIGN.md: scheduling, caching and planning, no device code.
CORE = (
    "scheduler", "cache_manager", "block_pool", "state_pool", "kv_hash", "request", "plan",
    "scheduler_output", "config", "memory_planner",
)  # fmt: skip


def test_the_core_never_imports_jax():
    """Imported in a fresh interpreter, the core modules pull in no jax, jaxlib or flax."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        + "".join(f"import serving.{m}\n" for m in CORE)
        + "heavy = ('jax', 'jaxlib', 'flax')\n"
        + "bad = [m for m in sys.modules if m.split('.')[0] in heavy]\n"
        + "assert not bad, bad[:5]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(CORE) <= set(import_graph("serving"))  # every name is a module of serving/

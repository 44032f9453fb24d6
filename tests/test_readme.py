"""The README's commands and snippets cannot drift from the code.

Every ``hyjax`` command in its shell blocks parses with the real argument parser (a renamed or
removed flag fails here); every Python block that imports something compiles; the client
snippet names the model ``hyjax serve`` serves by default. The client snippet also runs against
a live server in ``tests/serving/test_server.py`` (``test_readme_client_snippet``).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
from pathlib import Path

import pytest

from serving.engine.engine_args import resolve_model
from serving.entrypoints.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
PLACEHOLDERS = {"I": "0"}  # integer placeholders of the README's commands (--process-id I)


def blocks(lang: str) -> list[str]:
    """The fenced code blocks of one language, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), re.S | re.M)


def hyjax_commands() -> list[str]:
    """Each ``hyjax ...`` command of the shell blocks, continuation lines joined."""
    cmds = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            for part in line.split("&&"):
                if part.strip().startswith("hyjax "):
                    cmds.append(part.strip())
    return cmds


def client_snippet() -> str:
    (snippet,) = [b for b in blocks("python") if "from openai import OpenAI" in b]
    return snippet


def test_readme_has_the_commands_it_should():
    cmds = hyjax_commands()
    assert any(c.startswith("hyjax generate") for c in cmds)
    assert any(c.startswith("hyjax serve") for c in cmds)


@pytest.mark.parametrize("cmd", hyjax_commands())
def test_hyjax_commands_parse(cmd):
    # Placeholders stand for values; "[--flag X]" marks an optional part, "..." repetition,
    # "[engine flags]" (no flag in it) stands for any of them.
    cmd = re.sub(r"\[[^\]-]*\]", "", cmd)
    args = shlex.split(cmd.replace("[", "").replace("]", "").replace("...", ""))[1:]
    args = [PLACEHOLDERS.get(a, a) for a in args]
    try:
        build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"README command does not parse ({e.code}): {cmd}")


def test_python_snippets_compile_and_name_the_served_model():
    code = [b for b in blocks("python") if re.search(r"^(from|import) ", b, re.M)]
    assert len(code) >= 2  # the hyjax.LLM and the OpenAI client snippets
    for b in code:
        ast.parse(b)
    served = os.path.basename(os.path.normpath(resolve_model(None)))
    names = re.findall(r'model="([^"]+)"', client_snippet())
    assert names == [served], f"the client snippet asks for {names}; serve answers as {served}"

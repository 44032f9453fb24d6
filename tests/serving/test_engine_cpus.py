"""``hyjax serve --engine-cpus``: the CPU lists, the split with the HTTP process, every thread
pinned, and the engine process started on its CPUs."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from serving.engine.cpus import parse_cpu_list, split_engine_cpus
from serving.engine.engine_client import EngineClient


def test_cpu_lists():
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("0-2,5, 7-8") == {0, 1, 2, 5, 7, 8}
    for bad, match in [("a", "'a' is not N or N-M"), ("4-2", "'4-2' is not a range"),
                       ("1,", "'' is not N or N-M"), ("-1", "'-1' is not N")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            parse_cpu_list(bad)


def test_split_leaves_the_rest_to_http():
    assert split_engine_cpus("0-5", set(range(16))) == (set(range(6)), set(range(6, 16)))
    with pytest.raises(ValueError, match=r"CPUs \[8, 9, 10\] are not among the 8 .*\(0-7\)"):
        split_engine_cpus("6-10", set(range(8)))
    with pytest.raises(ValueError, match="leave at least one for the HTTP server"):
        split_engine_cpus("0-3", {0, 1, 2, 3})


def test_the_serve_flag_rejects_a_bad_list_before_loading():
    from serving.entrypoints.cli import main

    with pytest.raises(SystemExit, match="--engine-cpus 99999: CPUs"):
        main(["serve", "--engine-cpus", "99999", "--model", "/nonexistent"])


needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


@needs_two
def test_pin_process_moves_every_thread():
    """A thread started before the call moves too (os.sched_setaffinity(0) would move only
    the calling one)."""
    cpu = min(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import os, threading
        from serving.engine.cpus import pin_process
        go = threading.Event()
        seen = []
        t = threading.Thread(target=lambda: (go.wait(), seen.append(os.sched_getaffinity(0))))
        t.start()
        pin_process({{{cpu}}})
        go.set(); t.join()
        assert os.sched_getaffinity(0) == {{{cpu}}}, os.sched_getaffinity(0)
        assert seen == [{{{cpu}}}], seen
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@needs_two
def test_the_engine_process_starts_on_its_cpus():
    """The spawned engine process pins itself before it imports jax (its model path does not
    exist, so it then fails: the affinity is read while it starts)."""
    cpu = min(os.sched_getaffinity(0))
    client = EngineClient({"model": "/nonexistent/model"}, cpus={cpu})
    client._proc.start()
    seen = set()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and client._proc.is_alive():
            try:
                seen = os.sched_getaffinity(client._proc.pid)
            except ProcessLookupError:
                break
            if seen == {cpu}:
                break
            time.sleep(0.002)
    finally:
        client._proc.kill()
        client._proc.join(10)
    assert seen == {cpu}

"""``benchmarks.cmdbuf_updates``' log reading: XLA's command-buffer lines (their jaxlib 0.11
form) counted per measured run and per step."""

from __future__ import annotations

import json

from benchmarks.cmdbuf_updates import split_runs, summarize

PREFIX = "I1128 15:36:43.168964     780 "


def _step(updated: int, skipped_nested: int, us: int, device: int = 0) -> list[str]:
    """One launch that re-records: a nested executor (a conditional's branch), then the
    graph's own executor, the thunk's summary, and the launch."""
    return [
        PREFIX
        + f"command_buffer_thunk.cc:336] [{device}] Create/Update command buffer by recoding "
        "command buffer cmd sequence after 1 executions since last update; num_commands=294; "
        "updated_allocs=3; is_first_record=0; needs_update=1",
        PREFIX + f"command_executor.cc:669] Updated 14 commands in 12 μs (skipped "
        f"{skipped_nested} command updates)",
        PREFIX + f"command_executor.cc:669] Updated 294 commands in {us} μs (skipped "
        f"{294 - updated} command updates)",
        PREFIX + f"command_buffer_thunk.cc:362] [{device}] Updated command buffer in {us + 8} μs; "
        "num_commands=294",
        PREFIX
        + f"command_buffer_thunk.cc:371] [{device}] Execute command buffer; num_executions=1",
    ]


def test_counts_updates_per_step():
    launch_only = (
        PREFIX + "command_buffer_thunk.cc:371] [0] Execute command buffer; num_executions=2"
    )
    lines = _step(27, 9, 400) + _step(27, 9, 420) + [launch_only]
    got = summarize(lines, steps=3)
    assert got["graph_launches"] == 3 and got["graph_updates"] == 2
    assert got["moved_allocs_median"] == 3
    assert got["update_us_total"] == 408 + 428 and got["update_us_median"] == 418
    assert got["kernels_updated"] == 2 * (27 + 5) and got["kernels_skipped"] == 2 * (267 + 9)
    assert got["kernels_updated_per_step"] == round(64 / 3, 2)
    assert got["graph_launches_per_step"] == 1.0


def test_splits_the_measured_runs():
    run = {"concurrency": 8, "async_scheduling": True, "engine_steps": 2}
    text = "\n".join(
        ["warm-up noise", *_step(1, 0, 5), "compile: 1.0 s for 2 step buckets (concurrency 8)"]
        + _step(27, 9, 400)
        + [json.dumps(run), "after", "compile: 0.0 s for 0 step buckets (concurrency 8)"]
        + _step(2, 0, 7)
        + [json.dumps(run | {"async_scheduling": False})]
    )
    (first, seg1), (second, seg2) = split_runs(text)
    assert first["async_scheduling"] and not second["async_scheduling"]
    assert len(seg1) == len(seg2) == 5  # only the measured run's lines
    assert summarize(seg1, 2)["kernels_updated"] == 27 + 5
    assert summarize(seg2, 2)["update_us_total"] == 15


def test_splits_updates_by_device():
    """Under tensor parallelism each device's launches have their own thread; the log says
    which device each update was for."""
    lines = _step(27, 9, 400, device=0) + _step(5, 0, 30, device=1) + _step(5, 0, 50, device=1)
    got = summarize(lines, steps=2)
    assert got["by_device"]["0"]["graph_updates"] == 1 and got["by_device"]["0"]["update_us"] == 408
    assert got["by_device"]["1"]["graph_updates"] == 2 and got["by_device"]["1"]["update_us"] == 96
    assert got["by_device"]["1"]["update_us_per_step"] == 48.0
    assert got["update_us_total"] == 408 + 96

"""``benchmarks.http_serving``'s pure parts: the server gets the engine's flags, aiperf's
export is read into the engine's metric names."""

from __future__ import annotations

import pytest

from benchmarks.http_serving import (
    aiperf_summary,
    core_groups,
    parse_args,
    serve_flags,
    split_cores,
)
from serving.engine.engine_args import engine_kwargs
from serving.entrypoints.cli import build_parser


@pytest.mark.parametrize(
    "argv",
    [
        [],
        [
            "--concurrency",
            "8",
            "--dtype",
            "bfloat16",
            "--async-scheduling",
            "--enable-prefix-caching",
            "--compilation-cache-dir",
            "",
            "--cache-bytes",
            "1000000",
        ],
    ],  # fmt: skip
    ids=["defaults", "flags_changed"],
)
def test_serve_flags_rebuild_the_engine_args(argv):
    _, kwargs = parse_args(argv)
    ns = build_parser().parse_args(["serve", *serve_flags(kwargs)])
    assert engine_kwargs(ns, warmup=False, progress=False) == kwargs


def test_workload_defaults_shape_the_engine():
    _, kwargs = parse_args(["--concurrency", "8", "--input-len", "100", "--output-len", "20"])
    assert kwargs["max_num_seqs"] == 8
    assert kwargs["max_model_len"] == 100 + 20 + 64
    assert kwargs["min_token_bucket"] == kwargs["max_num_batched_tokens"]
    assert kwargs["mixed_row_buckets"] is False and kwargs["enable_prefix_caching"] is False


def test_aiperf_summary_names():
    pct = {"avg": 2.0, "p50": 1.0, "p90": 3.0, "p99": 4.0, "p25": 0.5}
    export = {
        "aiperf_version": "0.13.0",
        "request_count": {"avg": 16.0},
        "benchmark_duration": {"avg": 10.0},
        "total_output_tokens": {"avg": 1024.0},
        "output_token_throughput": {"avg": 102.4},
        "input_sequence_length": {"avg": 128.0},
        "output_sequence_length": {"avg": 64.0},
        "time_to_first_token": pct,
        "inter_chunk_latency": pct | {"p50": 1.5},
        "inter_token_latency": pct | {"p50": 2.5},
        "error_summary": [{"error_details": {"code": 500}, "count": 2}],
    }
    s = aiperf_summary(export)
    assert (s["requests"], s["errors"], s["output_tokens"]) == (16, 2, 1024)
    assert s["output_tok_per_s"] == 102.4
    assert s["ttft_ms"] == {"p50": 1.0, "p90": 3.0, "p99": 4.0, "mean": 2.0}
    assert s["itl_ms"]["p50"] == 1.5  # vLLM's ITL: the gaps between streamed chunks
    assert s["tpot_ms"]["p50"] == 2.5  # aiperf's "inter token latency" is vLLM's TPOT


def _topology(root, cores):  # cores: {cpu: (package, core)}
    for cpu, (pkg, core) in cores.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{pkg}\n")
        (d / "core_id").write_text(f"{core}\n")


def test_split_cpus_keeps_smt_siblings_on_one_side(tmp_path):
    # 4 cores of 2 threads, the siblings numbered apart (0 and 4 share a core), as on most hosts
    _topology(tmp_path, {c: (0, c % 4) for c in range(8)})
    groups = core_groups(str(tmp_path), cpus=set(range(8)))
    assert groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert split_cores(groups) == ({0, 4, 1, 5}, {2, 6, 3, 7})
    # two packages whose core ids repeat: one core each side of every id
    _topology(tmp_path / "two", {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)})
    assert core_groups(str(tmp_path / "two"), cpus={0, 1, 2, 3}) == [[0], [1], [2], [3]]


def test_split_cpus_needs_two_cores(tmp_path):
    _topology(tmp_path, {0: (0, 0), 1: (0, 0)})
    with pytest.raises(ValueError, match="two physical cores"):
        split_cores(core_groups(str(tmp_path), cpus={0, 1}))
    # unreadable topology: a core a CPU
    assert core_groups(str(tmp_path / "none"), cpus={3, 1}) == [[1], [3]]

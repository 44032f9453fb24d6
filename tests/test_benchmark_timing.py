"""The benchmarks' timed programs time what a call costs (``benchmarks.common``)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.common import distinct_copies, stateful_chain


def _dots(chain, state, operand_sets, *acc) -> int:
    hlo = chain.lower(state, operand_sets, *acc).compile().as_text()
    return sum(" dot(" in line for line in hlo.splitlines())


def test_timed_chain_computes_a_state_independent_part_in_every_call():
    # The delta-rule prefill's intra launch does not read the state: with one operand set
    # shared by the chained calls, XLA computed it once for all of them (2026-11-29)
    def step(state, x, w):
        return state + 1.0, jnp.tanh(x @ w)  # x @ w reads no state

    x = jnp.arange(64.0).reshape(8, 8) / 64
    w = jnp.eye(8) * 0.5
    chain = stateful_chain(step, 3)
    assert _dots(chain, jnp.zeros(4), distinct_copies((x, w), 3), jnp.zeros(())) == 3

    @jax.jit
    def shared(state, operands):  # the chain as it was: every call on the same operands
        acc = jnp.zeros(())
        for _ in range(3):
            state, out = step(state, *operands)
            acc = acc + out[0, 0]
        return state, acc

    assert _dots(shared, jnp.zeros(4), (x, w)) == 1  # one product for the three calls


def test_timed_chain_writes_its_outputs_where_the_last_run_left_them():
    # A new output buffer every run moved an allocation of the program's CUDA graph, which XLA
    # then re-recorded before each launch: ~1 ms of host before the device started, a third
    # of the 1x4096 prefill's figure (H200, 2026-11-30). The state and the consumed outputs'
    # scalar are donated: each run's outputs take its inputs' buffers.
    def step(state, x):
        return state * 0.5 + x, jnp.tanh(x)

    chain = stateful_chain(step, 2)
    state, acc = jnp.ones(4), jnp.zeros(())
    operands = distinct_copies((jnp.arange(1.0, 5.0),), 2)
    new_state, new_acc = chain(state, operands, acc)
    assert state.is_deleted() and acc.is_deleted()  # both donated
    one = float(jnp.tanh(1.0))
    assert float(new_acc) == pytest.approx(2 * one, rel=1e-6)  # each call's output consumed
    _, new_acc = chain(new_state, operands, jnp.full((), 7.0))
    assert float(new_acc) == pytest.approx(2 * one, rel=1e-6)  # reset, not carried across runs


def test_distinct_copies_are_equal_and_their_own_buffers():
    x = jnp.arange(6.0)
    sets = distinct_copies((x, {"y": x + 1}), 2)
    assert len(sets) == 2
    for a, b in sets:
        assert (a == x).all() and (b["y"] == x + 1).all()
        assert a.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    assert sets[0][0].unsafe_buffer_pointer() != sets[1][0].unsafe_buffer_pointer()


def test_register_counts_read_the_intra_launch(tmp_path):
    # benchmarks.triton_registers compiles what it writes here with another Triton: it must be
    # the intra launch's Triton IR, with no debug locations (that Triton cannot parse the ones
    # jax prints; written with them, this fails)
    from benchmarks.triton_registers import dump_intra_ttir

    for kernel, names in [("gdn_blocked_bf16", ["gdn_prefill_intra_gpu"]),
                          ("gdn_split_blocked_bf16", ["gdn_prefill_intra_scores_gpu",
                                                      "gdn_prefill_intra_wu_gpu"]),
                          ("kda", ["kda_prefill_intra_gpu"])]:  # fmt: skip
        paths = dump_intra_ttir(kernel, str(tmp_path))
        assert len(paths) == len(names)
        for path, name in zip(paths, names, strict=True):
            text = open(path).read()
            assert text.startswith(f"module @{name} "), text[:80]
            assert "tt.dot" in text and "loc(" not in text


def test_region_profile_summary_reads_cycles_a_chunk(tmp_path):
    """``benchmarks.mgpu_regions.summarise``: Mosaic GPU's trace (``ts`` the clock / 1e3, B/E
    events per warpgroup ``tid``) read back as cycles a chunk per region, averaged over the
    warpgroups, and the loop's span a chunk."""
    import json

    from benchmarks.mgpu_regions import summarise

    events = []
    for tid, (wait, mma) in {1: (5, 10), 2: (15, 30)}.items():
        clock = 1000 * tid
        for _ in range(4):  # four chunks
            for name, cycles in (("wait", wait), ("mma1", mma)):
                events.append({"name": name, "ph": "B", "ts": clock / 1e3, "pid": 1, "tid": tid})
                clock += cycles
                events.append({"name": name, "ph": "E", "ts": clock / 1e3, "pid": 1, "tid": tid})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = summarise(str(path), chunks_per_row=4)
    assert got["warpgroups"] == 2
    assert abs(got["wait_cycles_per_chunk"] - 10.0) < 1e-6  # (5 + 15) / 2
    assert abs(got["mma1_cycles_per_chunk"] - 20.0) < 1e-6
    assert abs(got["loop_cycles_per_chunk"] - 30.0) < 1e-6  # (15 + 45) / 2
    lo, hi = got["mma1_p10_p90"]
    assert 10.0 < lo < hi < 30.0


def test_prefill_gaps_timeline_names_the_kernels_around_each_gap():
    # benchmarks.prefill_gaps: where a device waits between kernels, and between which
    from benchmarks.prefill_gaps import timeline

    events = [  # (overlapping kernels: no gap; a kernel inside another's span: none either)
        {"name": "a", "ts": 0.0, "dur": 10.0},
        {"name": "b", "ts": 15.0, "dur": 5.0},  # 5 us after a
        {"name": "c", "ts": 18.0, "dur": 1.0},  # inside b's span
        {"name": "a", "ts": 30.0, "dur": 2.0},  # 10 us after b's end
        {"name": "b", "ts": 40.0, "dur": 1.0},  # 8 us after a
    ]
    tl = timeline(events)
    assert tl["kernels"] == 5
    assert tl["span_us"] == 41.0 and tl["busy_us"] == 19.0 and tl["gaps_us"] == 23.0
    by_pair = {(g["before"], g["after"]): g["us"] for g in tl["gaps_by_pair"]}
    assert by_pair[("a", "b")] == 13.0  # 5 + 8
    assert by_pair[("c", "a")] == 10.0
    assert by_pair[("b", "c")] == 0.0


def test_prefill_gaps_names_the_jax_ops_of_each_fusion():
    # benchmarks.prefill_gaps: which jax ops an XLA kernel of the trace computes, from the
    # optimized HLO (the same text format on every backend)
    from benchmarks.prefill_gaps import fusion_index

    def f(x, y):
        return jnp.exp(y).T.sum(1) + (jnp.tanh(x) * 2 + y).sum(0)

    hlo = jax.jit(f).lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile().as_text()
    index = fusion_index(hlo)
    assert index and all("." not in name for name in index)  # as a trace names kernels
    made = [e for e in index.values() if "tanh" in e["ops"]]
    assert len(made) == 1 and "parameter" not in made[0]["ops"]
    assert any(k.endswith("/tanh") for k in made[0]["from"])

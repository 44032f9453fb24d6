"""``EngineArgs``: the flags shared by ``hyjax generate``, ``hyjax serve`` and ``LLM``, each
written once. A field with a help text is a command-line flag (``--max-num-seqs`` for
``max_num_seqs``); :func:`add_engine_args` builds the flags from the fields and
:func:`engine_kwargs` reads them back. No jax here: the HTTP process imports this.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

_NO_FLAG = object()


def _flag(default: Any, help: str, *, cli_default: Any = _NO_FLAG, **argparse_kw) -> Any:
    """A field that is also a flag; ``cli_default``: the flag's default where it differs from
    the field's (resolved by :func:`engine_kwargs`), ``argparse_kw``: ``type``, ``choices``."""
    meta = {"help": help, "argparse": argparse_kw}
    if cli_default is not _NO_FLAG:
        meta["cli_default"] = cli_default
    return dataclasses.field(default=default, metadata=meta)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _speculative_config(text: str) -> str:
    """``--speculative-config``'s check at parse time (the engine parses it again)."""
    from serving.core.speculative import SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """The engine's configuration. Fields with a help text are the CLI's engine flags."""

    model: str = _flag(
        dataclasses.MISSING,
        "a Hugging Face checkpoint directory (default: the embedded qwen3-next-pystdlib-tiny, "
        "trained on Python's standard library)",
        cli_default=None,
    )
    load_format: str = _flag(
        "auto",
        "auto: the checkpoint's weights (safetensors, or a directory of hyjax convert); dummy: "
        "random weights from --model's config.json alone, each drawn in its shard (no "
        "checkpoint needed; without a tokenizer in the directory the embedded model's is used, "
        "and generated ids past its vocabulary decode to nothing)",
        choices=["auto", "dummy"],
    )
    dtype: str = _flag(
        "auto",
        "the weights' and activations' type (auto: the checkpoint's; float32 for the embedded "
        "model)",
        choices=["auto", "float32", "bfloat16"],
    )
    block_size: int = _flag(16, "tokens per KV cache block", type=int)
    max_num_seqs: int = _flag(32, "requests running at once (a step's rows)", type=int)
    max_num_batched_tokens: int = _flag(
        512, "tokens per step: the prefill chunk budget and the largest token bucket", type=int
    )
    max_model_len: int | None = _flag(
        None, "longest prompt + completion (default: the model's max_position_embeddings)", type=int
    )
    min_token_bucket: int = _flag(
        8, "the smallest token capacity of a prefill step: larger means fewer compiles", type=int
    )
    min_seq_bucket: int = _flag(
        1,
        "the smallest row count of a decode step: fewer rows pad to it (one compile for all "
        "counts up to it; padded rows still cost compute)",
        type=int,
    )
    mixed_row_buckets: bool | None = _flag(
        None,
        "prefill steps pad their rows to a power of two (a bucket per row count) instead of to "
        "min(tokens, --max-num-seqs); default: off on CPU (a quarter of the compiles and their "
        "memory), on elsewhere",
    )
    max_prompt_logprobs: int = _flag(
        256,
        "prompt positions one step may score for requests with prompt_logprobs or echo + "
        "logprobs (0: refused); the step holds that many rows of vocabulary logits meanwhile",
        type=int,
    )
    enable_prefix_caching: bool = _flag(
        True, "reuse cached KV blocks and recurrent-state checkpoints of repeated prefixes"
    )
    checkpoint_interval: int | None = _flag(
        None,
        "granularity of state checkpoints and prefill chunk edges, in tokens (default: "
        "lcm(64, block size))",
        type=int,
    )
    retention_interval: int = _flag(
        0,
        "also keep a state checkpoint every this many prompt tokens (0: only at the prompt end "
        "and the latest decode boundary)",
        type=int,
    )
    scheduling_policy: str = _flag(
        "fcfs",
        "admission order of waiting requests: fcfs (arrival), or lpm (longest prefix match "
        "first, as SGLang's --schedule-policy lpm: requests that hit the cache start before "
        "those that compute their prefix, and none waits behind a checkpoint still being "
        "written; arrival order past 128 waiting)",
        choices=["fcfs", "lpm"],
    )
    kernel_backend: str = _flag(
        "auto",
        "auto: Pallas kernels on GPU / TPU, the pure-JAX reference ops on CPU; interpret / "
        "interpret-gpu: the TPU / GPU kernels in Pallas' interpreter on CPU (tests)",
        choices=["auto", "reference", "pallas", "interpret", "interpret-gpu"],
    )
    state_dtype: str = _flag(
        "float32",
        "the recurrent (GDN / KDA) states' type in the state pool: bfloat16 halves a slot's "
        "bytes (about twice the running and cached-prefix slots per GiB) and rounds the state "
        "at every store; the kernels compute in float32 either way",
        choices=["float32", "bfloat16"],
    )
    allow_tf32: bool = _flag(
        False,
        "float32 models: let matmuls use TF32 tensor cores on NVIDIA (bf16 passes on TPU): "
        "faster, ~1e-3 relative error; by default float32 means IEEE float32 products",
    )
    num_checkpoint_slots: int | None = _flag(
        None, "state slots kept for prefix-cache checkpoints (default: from the cache budget)",
        type=int,
    )  # fmt: skip
    cache_bytes: int | None = _flag(
        None,
        "bytes per device for the KV and state pools (default: 90%% of the free device memory; "
        "on CPU, max-num-seqs full-length requests); with several processes, every process "
        "sizes its pools for the smallest budget of them all",
        type=positive_int,
    )
    seed: int | None = _flag(0, "the sampler's seed for unseeded requests", type=int)
    async_scheduling: bool | None = _flag(
        None,
        "schedule step N+1 while step N runs on the device (its decode rows read step N's "
        "tokens on the device): the host's scheduling, detokenizing and output overlap the "
        "device; outputs are the same as without it; default: on for one process on a GPU or "
        "TPU, off on CPU (host and device share the cores) and with several processes",
    )
    dispatch_thread: bool = _flag(
        False,
        "with async scheduling, launch each step from a thread of its own: the launch (the "
        "calling thread held for XLA's whole launch sequence, one launch per collective under "
        "tensor parallelism) overlaps the engine's output processing and next scheduling; "
        "outputs are the same as without it",
    )
    speculative_config: str | None = _flag(
        None,
        'speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": '
        'K, "prompt_lookup_min": m, "prompt_lookup_max": M}\' (prompt lookup: drafts are the K '
        "tokens that followed the last m..M tokens earlier in the request); greedy outputs are "
        "the same as without it, sampled ones have the same distribution. Rows that use "
        "penalties, logit bias, min_tokens or logprobs do not speculate",
        type=lambda text: _speculative_config(text),
    )
    verify_buckets: bool = _flag(
        True,
        "speculative decoding: steps whose rows are all decode / verify rows (at most K + 1 "
        "tokens each) run in verify-shaped buckets through the k-token decode kernels; "
        "--no-verify-buckets runs them in the prefill-shaped buckets (fewer compiles)",
    )
    branch_free_step: bool | None = _flag(
        None,
        "compute the step's sampler and log-prob branches on every step and select, instead "
        "of lax.cond: the step holds no conditional, so XLA:GPU keeps the launches between "
        "its collectives in fewer, larger CUDA graphs (and may keep NCCL collectives in them, "
        "XLA_FLAGS=--xla_gpu_enable_command_buffer=+COLLECTIVES: NCCL cannot instantiate a "
        "graph holding conditional nodes); costs the branches' work every step; default: on "
        "for tensor parallel on a GPU (1.17x output tok/s on the 48-layer 80B at TP 2, two "
        "H200s), off elsewhere",
    )
    scan_layers: bool = _flag(
        False,
        "run the repeating layer group as one lax.scan (parameters and pools stacked per group "
        "position): compile time does not grow with depth; on one device and under tensor / "
        "expert parallel (the stacked parameters keep their layer's split behind an unsplit "
        "group axis); a stacked pool must stay under 2^31 elements per device (the GPU "
        "kernels' offsets: the memory planner caps the pools)",
    )
    # Devices the model is split over (hyjax.sharding): heads of GDN / attention and the MoE
    # experts' intermediate dim, or (expert parallel) the experts themselves.
    tensor_parallel_size: int = _flag(
        1, "devices the model is split over (heads, MoE intermediate dim; hyjax.sharding)", type=int
    )
    enable_expert_parallel: bool = _flag(
        False, "split the MoE layers by expert instead of by intermediate dim"
    )
    # JAX's persistent compilation cache: compiled buckets are kept here, so a restart with the
    # same model shapes, flags and jax version loads them instead of compiling (minutes with the
    # kernels on a GPU). None: not used.
    compilation_cache_dir: str | None = _flag(
        None,
        "JAX's persistent compilation cache: restarts load the compiled buckets from here ('' "
        "turns it off; env HYJAX_COMPILATION_CACHE sets the default)",
        cli_default=lambda: os.environ.get(
            "HYJAX_COMPILATION_CACHE", "~/.cache/hyjax/jax-compilation"
        ),
    )
    # Set by the command, not flags. Compile every step bucket before serving (``warmup``), or,
    # with ``background_warmup`` too, in a background thread while serving: the engine is ready
    # at once and a step whose bucket is not compiled yet compiles it then (``hyjax serve``).
    # ``warmup=False``: each bucket compiles when a step first meets it (``hyjax generate``).
    warmup: bool = True
    background_warmup: bool = False
    progress: bool = True


def flag_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineArgs) if "help" in f.metadata]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags shared by ``generate`` and ``serve``, one per flag field."""
    for f in flag_fields():
        kw = dict(f.metadata["argparse"])
        default = f.metadata.get("cli_default", f.default)
        default = default() if callable(default) else default
        if f.default is False:
            kw["action"] = "store_true"
        elif f.default is True or f.type == "bool | None":
            kw["action"] = argparse.BooleanOptionalAction
        name = "--" + f.name.replace("_", "-")
        p.add_argument(name, default=default, help=f.metadata["help"], **kw)


def engine_kwargs(ns: argparse.Namespace, **extra) -> dict:
    """``EngineArgs`` fields from the flags, as a dict (``serve`` sends it to the engine
    process without importing the engine, hence jax, itself)."""
    kw = {f.name: getattr(ns, f.name) for f in flag_fields()}
    if kw["model"] is None and kw["dtype"] == "auto":
        # The embedded model is stored in bfloat16 to stay small; it runs in float32, which is
        # many times faster on CPU (where bf16 products are emulated) and costs 34 MB.
        kw["dtype"] = "float32"
    kw["model"] = resolve_model(kw["model"])
    kw["compilation_cache_dir"] = kw["compilation_cache_dir"] or None
    return {**kw, **extra}


def resolve_model(model: str | None) -> str:
    """``--model`` as given, or the embedded default model's directory when it is omitted."""
    if model is not None:
        return model
    from hyjax.assets import model_dir

    return model_dir()

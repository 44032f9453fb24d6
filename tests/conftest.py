import os

from tests.xla_flags import TEST_XLA_FLAGS

# Tests run on CPU in float32, with compile-time-lean XLA flags (tests/xla_flags.py).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
# The CLI keeps a persistent compilation cache under ~/.cache by default; tests start from a cold
# one (tests/serving/test_compilation_cache.py checks the cache itself, in a temporary dir).
# Not one cache shared by the run's processes either: tried, and a worker crashed reading an
# entry (SIGSEGV in jax's compilation_cache.get_executable_and_time, jax 0.10.2 on CPU; cause
# not found: two xdist workers and servers wrote and read the directory at once).
os.environ.setdefault("HYJAX_COMPILATION_CACHE", "")


def _triton_lowers_for_an_h200_here() -> None:
    """jax 0.11's Triton lowering asks the default device's GPU info (compute capability),
    which a CPU host has none of, so every ``lower(lowering_platforms=("cuda",))`` of a
    Triton kernel failed there ("No supported GPU devices found"); jax 0.10 lowered without
    it. The tests' lowerings target an H200 (the card of BENCHMARKS.md): the CPU's device kind
    stands for one, in the registry jax keeps for device kinds it does not know."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:  # jax 0.10: no such query
        return
    gpu_info.registry.setdefault(
        "cpu", lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    )


_triton_lowers_for_an_h200_here()

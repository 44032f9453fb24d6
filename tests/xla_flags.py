"""XLA flags of every test process (this one and the subprocesses tests start), on CPU.

- one thread for Eigen: the 2-core CI box runs two test workers (and their servers) at once;
- LLVM at -O0, its expensive passes off: the tests' programs are small and compile-bound (an
  engine test runs ~35 % faster at -O0, ~8-10 % more without the expensive passes). IEEE
  semantics are the same at every LLVM level (no fast-math), so are the results;
- XLA:CPU's legacy fusion emitters instead of the MLIR fusion emitters: an engine test compiles
  ~40 % faster (33 s -> 20 s for the Kimi speculative-decoding test on the 2-core CI box).
  jaxlib 0.10 only: 0.11's XLA has no such flag (an H200 host with jax 0.11.2 aborted on it).
"""

from importlib.metadata import version


def jaxlib_before(major: int, minor: int) -> bool:
    """Whether the installed jaxlib is older than ``major.minor``."""
    return tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (major, minor)


# (jaxlib 0.11's XLA has no legacy emitters, and aborts on the flag that asked for them)
TEST_XLA_FLAGS = (
    "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true"
    + (" --xla_cpu_use_fusion_emitters=false" if jaxlib_before(0, 11) else "")
)


def with_devices(count: int) -> str:
    """The test flags with ``count`` simulated CPU devices."""
    return f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={count}"

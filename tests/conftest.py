import os

# Tests run on CPU in float32; keep XLA from grabbing every core of the 2-core CI box twice.
# LLVM at -O0: the tests' programs are small and compile-bound (an engine test runs ~35 %
# faster); IEEE semantics are the same at every LLVM level (no fast-math), so are the results.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0"
)
# The CLI keeps a persistent compilation cache under ~/.cache by default; tests start from a cold
# one (tests/serving/test_compilation_cache.py checks the cache itself, in a temporary dir).
# Not one cache shared by the run's processes either: tried, and a worker crashed reading an
# entry (SIGSEGV in jax's compilation_cache.get_executable_and_time, jax 0.10.2 on CPU; cause
# not found: two xdist workers and servers wrote and read the directory at once).
os.environ.setdefault("HYJAX_COMPILATION_CACHE", "")

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

import os
import shutil
import tempfile

# Tests run on CPU in float32; keep XLA from grabbing every core of the 2-core CI box twice.
# LLVM at -O0: the tests' programs are small and compile-bound (an engine test runs ~35 %
# faster); IEEE semantics are the same at every LLVM level (no fast-math), so are the results.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0"
)
# One persistent compilation cache for the whole run, in a temporary directory: a step program
# one test compiled (same model, shapes and flags) is loaded by the next test that builds it,
# in this process, the other xdist worker (started after this, so with this environment) and
# the servers tests start. Never the user's ~/.cache one: a run starts cold.
# (tests/serving/test_compilation_cache.py checks the cache itself, in its own directory.)
if not os.environ.get("HYJAX_TEST_COMPILATION_CACHE"):
    os.environ["HYJAX_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="hyjax-test-xla-")
    _OWNS_CACHE = True  # the process that made it (xdist's controller) removes it at the end
else:
    _OWNS_CACHE = False
os.environ["HYJAX_COMPILATION_CACHE"] = os.environ["HYJAX_TEST_COMPILATION_CACHE"]


def pytest_configure(config):
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["HYJAX_COMPILATION_CACHE"])
    # Programs that compile in under a second are not worth a disk entry (JAX's default).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def pytest_unconfigure(config):
    if _OWNS_CACHE:
        shutil.rmtree(os.environ["HYJAX_TEST_COMPILATION_CACHE"], ignore_errors=True)

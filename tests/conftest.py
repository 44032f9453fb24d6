import os

# Tests run on CPU in float32; keep XLA from grabbing every core of the 2-core CI box twice.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

#!/usr/bin/env bash
# Trains the embedded default model (hyjax/assets/qwen3-next-pystdlib-tiny) on one GPU.
#
#   benchmarks/train_default_model.sh --out /tmp/run [hyjax.training.train flags]
#
# The corpus is the CPython 3.11.7 standard library's *.py files (Lib/ with its test suite,
# no site-packages), packed as .corpus/stdlib-3.11.7.tar.xz so that every machine trains on the
# same text whatever its own interpreter. Make the archive from any CPython 3.11.7 with
#   cd "$(python3.11 -c 'import sysconfig, os; print(os.path.dirname(sysconfig.get_paths()["stdlib"]))')"
#   find python3.11 -name '*.py' -not -path '*/site-packages/*' | sort > /tmp/files
#   tar -cJf .corpus/stdlib-3.11.7.tar.xz -T /tmp/files
# Without the archive the running interpreter's own standard library is used.
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
ARGS=()
if [[ -f .corpus/stdlib-3.11.7.tar.xz ]]; then
  rm -rf /tmp/hyjax-stdlib && mkdir -p /tmp/hyjax-stdlib
  tar -xJf .corpus/stdlib-3.11.7.tar.xz -C /tmp/hyjax-stdlib
  ARGS+=(--stdlib /tmp/hyjax-stdlib/python3.11)
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c 'import jax, flax, optax, orbax.checkpoint, tokenizers; print(jax.__version__, jax.devices(), flax.__version__, optax.__version__, tokenizers.__version__)'
exec "$PY" -m hyjax.training.train "${ARGS[@]}" "$@"

#!/usr/bin/env bash
# Trains an MTP head (hyjax/training/mtp.py) on the frozen embedded default model and exports
# the model directory with mtp.* added (copy its model.safetensors and config.json into
# hyjax/assets/qwen3-next-pystdlib-tiny to ship it).
#
#   benchmarks/train_default_mtp.sh --out /tmp/mtp [hyjax.training.mtp flags]
#
# Same corpus as benchmarks/train_default_model.sh (the archive when present, else this
# interpreter's standard library), encoded with the shipped tokenizer.
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
ARGS=(--model hyjax/assets/qwen3-next-pystdlib-tiny)
if [[ -f .corpus/stdlib-3.11.7.tar.xz ]]; then
  rm -rf /tmp/hyjax-stdlib && mkdir -p /tmp/hyjax-stdlib
  tar -xJf .corpus/stdlib-3.11.7.tar.xz -C /tmp/hyjax-stdlib
  ARGS+=(--stdlib /tmp/hyjax-stdlib/python3.11)
fi
exec "$PY" -m hyjax.training.mtp "${ARGS[@]}" "$@"

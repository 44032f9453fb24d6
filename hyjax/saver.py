"""Writing a model back as a Hugging Face checkpoint (``config.json`` + ``model.safetensors``).

The inverse of :mod:`hyjax.loader`, through the same name table (the family's ``targets``), so
what hyjax saves loads in transformers and in hyjax alike (used for the tiny demo model and for
trained models).
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from flax import nnx

from hyjax.config import ModelConfig
from hyjax.models import family_of
from hyjax.safetensors_io import save_file

_NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def save_hf_checkpoint(model: nnx.Module, cfg: ModelConfig, out_dir: str | os.PathLike) -> None:
    """Writes ``config.json`` and ``model.safetensors`` (weights in ``cfg.dtype``)."""
    os.makedirs(out_dir, exist_ok=True)
    params = {k: v[...] for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    dtype = _NP[cfg.dtype]
    family = family_of(cfg)
    tensors = {}
    for name, tg in family.targets(cfg).items():
        arr = np.asarray(params[tg.path])
        if tg.expert is not None:
            arr = arr[tg.expert]
        if tg.transform == "t":
            arr = np.swapaxes(arr, -1, -2)
        elif tg.transform == "conv":
            arr = arr[:, None, :]
        elif tg.transform == "flat" and tg.stored_shape is not None:
            arr = arr.reshape(tg.stored_shape)
        keep_f32 = tg.path[-1] in family.float32_params
        tensors[name] = np.ascontiguousarray(arr.astype(np.float32 if keep_f32 else dtype))
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)

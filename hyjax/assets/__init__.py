"""Models shipped inside the package, so hyjax runs offline on a fresh machine.

``qwen3-next-pystdlib-tiny``: an 8-layer Qwen3-Next (Gated DeltaNet + gated attention + MoE)
trained on the CPython standard library's source by :mod:`hyjax.training.train`; see its
``MODEL_CARD.md``. ``hyjax generate`` and ``hyjax serve`` use it when ``--model`` is not given.
It is an ordinary Hugging Face checkpoint directory and loads through :mod:`hyjax.loader`.
"""

from __future__ import annotations

import os

DEFAULT_MODEL = "qwen3-next-pystdlib-tiny"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def model_dir(name: str = DEFAULT_MODEL) -> str:
    """The directory of a shipped model; raises if the package was installed without it."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    missing = [f for f in _REQUIRED if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise FileNotFoundError(
            f"the embedded model {name!r} is incomplete at {path!r} (missing {missing}); "
            "reinstall hyjax, or pass --model DIR"
        )
    return path

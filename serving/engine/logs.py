"""Logging set-up shared by the CLI and the engine process (no jax here)."""

from __future__ import annotations

import logging


def setup_logging(quiet: bool) -> None:
    """INFO lines (warnings only with ``--quiet``), without JAX's note that a platform it
    probes for is absent (``Unable to initialize backend 'tpu'``, on every start)."""
    level = logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(max(level, logging.WARNING))

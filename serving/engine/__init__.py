"""The engine: requests in, token and text deltas out, one step at a time (``LLMEngine``), in
this process or in a process of its own that ``EngineClient`` spawns and speaks ``messages``
with; ``multihost`` runs it across processes.

The HTTP process imports this package and must not import jax: ``LLMEngine`` and
``RequestOutput`` (whose module imports it) load on first use.
"""

from serving.engine.engine_args import EngineArgs
from serving.engine.engine_client import EngineClient

__all__ = ["EngineArgs", "EngineClient", "LLMEngine", "RequestOutput"]


def __getattr__(name: str):
    if name in ("LLMEngine", "RequestOutput"):
        from serving.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The entrypoints: the ``hyjax`` command (``cli``), the offline ``LLM`` API, and the
OpenAI-compatible HTTP server (``server``, ``openai_api``, ``protocol``, ``http_metrics``),
whose process never imports jax.

Nothing is imported here up front: ``LLM`` imports jax, and ``python -m
serving.entrypoints.cli`` imports this package before it runs ``cli`` as ``__main__``.
"""

__all__ = ["LLM", "main"]


def __getattr__(name: str):
    if name == "LLM":
        from serving.entrypoints.llm import LLM

        return LLM
    if name == "main":
        from serving.entrypoints.cli import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

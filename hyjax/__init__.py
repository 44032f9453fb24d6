"""hyjax: serving hybrid linear-attention language models in JAX and Pallas.

``hyjax.LLM`` and ``hyjax.SamplingParams`` are the offline API (imported lazily, so that
``import hyjax`` stays light).
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "LLM":
        from serving.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from serving.core.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'hyjax' has no attribute {name!r}")

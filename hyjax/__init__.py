"""hyjax: serving hybrid linear-attention language models in JAX and Pallas."""

__version__ = "0.1.0"

"""Training the embedded default model: corpus and tokenizer (``data``), a dense differentiable
forward over ``[B, T]`` batches that reuses the serving model's NNX modules (``dense``, with the
chunked gated delta rule of ``chunked``), and the optax/orbax loop with export (``train``).

The serving forward works on one flat ragged batch over paged caches, and its reference GDN
prefill scans token by token: right for serving and as an oracle, far too slow to train
through. Training runs this dense path instead; a test pins its logits to the serving path's.
"""

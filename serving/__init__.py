"""Serving, in four boxes, each importing only from those listed after it:

- ``serving.entrypoints``: the ``hyjax`` command, the offline ``LLM`` API, the OpenAI server;
- ``serving.engine``: the engine loop, its process, the client that talks to it, multi-host;
- ``serving.worker``: the jitted step, its pools and the sampler (the only device code);
- ``serving.core``: requests, the scheduler, the cache manager, the plan (plain Python).

``tests/test_structure.py`` checks the order, and that ``serving.core`` never imports jax.
"""

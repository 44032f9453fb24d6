"""Serving: request, scheduler and cache manager (plain Python), runner, engine, server.

``serving.core`` holds the plain-Python part (no jax), ``serving.worker`` the device side,
``serving.engine`` the engine and its process. Nothing in this package's ``__init__`` imports
jax.
"""

"""Serving: request, scheduler and cache manager (plain Python), runner, engine, server.

``serving.core`` holds the plain-Python part (no jax), ``serving.worker`` the device side.
Nothing in this package's ``__init__`` imports jax.
"""

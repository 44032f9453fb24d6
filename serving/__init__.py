"""Serving: request, scheduler and cache manager (plain Python), runner, engine, server.

``serving.core`` holds the plain-Python part (no jax); nothing in this package's ``__init__``
imports jax either. Import the parts from their packages or modules (``serving.core``, ...).
"""

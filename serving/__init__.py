"""Serving: request, scheduler and cache manager (plain Python), runner, engine, server.

Nothing in this package's ``__init__`` imports jax, so the scheduler side can be used and tested
without it. Import the parts from their modules (``serving.scheduler``, ``serving.config``, ...).
"""

"""The step's compiled executables by bucket, kept in memory and, with a directory, on disk.

Calling the jitted ``_step`` traces and lowers it before JAX's caches (in memory, or the
persistent compilation cache) can answer: the cache key is the lowered module. For the
48-layer Qwen3-Next-80B with its Pallas kernels that is seconds per bucket (a 48-layer decode
step traced and lowered for CUDA on this project's 2-core CI host: 12.5 s, a prefill step
20.7 s), paid again by the first step of every bucket the background warm-up compiled, and by
every bucket of a warm start. Here a bucket's executable is kept as compiled (``Compiled``,
called with the step's dynamic arguments), and written to disk with
``jax.experimental.serialize_executable``: a warm start loads it without tracing anything.

A disk entry is named by a fingerprint of everything that shapes the executable: the sources
of the ``hyjax``, ``serving`` and ``pallas_kernels`` packages, the jax and jaxlib versions, the
devices, ``XLA_FLAGS``, the model's config, the ops and every fixed argument's shape, dtype and
sharding (the runner's part), and the bucket. An entry that fails to load is compiled again
and overwritten, with one log line.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import jax

log = logging.getLogger(__name__)

_PACKAGES = ("hyjax", "serving", "pallas_kernels")


@functools.cache
def source_fingerprint() -> str:
    """sha256 of the Python sources of the packages the step is built from."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    h = hashlib.sha256()
    for package in _PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def environment_fingerprint() -> str:
    """The versions and devices an executable is compiled for, with ``XLA_FLAGS``."""
    import jaxlib

    devices = [(d.platform, getattr(d, "device_kind", ""), d.id) for d in jax.devices()]
    parts = (
        jax.__version__, jaxlib.__version__, repr(devices), os.environ.get("XLA_FLAGS", ""),
        *(repr(getattr(jax.config, name, None))
          for name in ("jax_default_matmul_precision", "jax_enable_x64")),
    )  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def describe_args(tree: Any) -> str:
    """Every array leaf's shape, dtype and sharding, in order (a stable text)."""
    leaves, treedef = jax.tree.flatten(tree)
    return repr(treedef) + ";".join(
        f"{x.shape}{x.dtype}{getattr(x, 'sharding', '')}" for x in leaves
    )


class StepExecutables:
    """Compiled steps by bucket key; with ``directory``, each also serialized there."""

    process_compiles = 0  # compiled by every instance in this process

    keep_fingerprints = 4  # on disk: this engine's and the 3 most recently used others

    def __init__(self, fingerprint: str, directory: str | None = None):
        self.fingerprint = fingerprint
        self.directory = None
        if directory is not None:  # one folder per fingerprint, the least recent ones dropped
            digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:24]
            self.directory = os.path.join(directory, digest)
            _prune(directory, keep=self.keep_fingerprints, mine=self.directory)
        self._memory: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.compiled = 0  # compiled in this process
        self.loaded = 0  # loaded from disk
        self.from_disk: set[str] = set()  # the keys of those loaded, until discarded

    @staticmethod
    def key(bucket: str) -> str:
        """A bucket's file name (the folder and the instance are the fingerprint's already)."""
        return hashlib.sha256(bucket.encode()).hexdigest()[:32]

    def get(self, key: str, in_tree_of: Callable[[], Any]) -> Any | None:
        """The executable of ``key`` from memory, else from disk (``in_tree_of()``: the
        dynamic arguments, whose structure the executable is called with), else None."""
        exe = self._memory.get(key)
        if exe is not None or self.directory is None:
            return exe
        path = os.path.join(self.directory, key + ".exe")
        if not os.path.exists(path):
            return None
        from jax.experimental import serialize_executable

        try:
            with open(path, "rb") as f:
                payload, out_tree = pickle.load(f)
            in_tree = jax.tree.structure((tuple(in_tree_of()), {}))
            exe = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # a stale or torn entry: compile again
            log.warning("step executable %s not loaded (%r): compiling it again", path, e)
            return None
        with self._lock:
            self._memory[key] = exe
            self.loaded += 1
            self.from_disk.add(key)
        return exe

    def discard(self, key: str) -> None:
        """Forgets ``key``'s executable, in memory and on disk: one loaded from disk that does
        not run (the warm-up found it broken) is compiled and written again."""
        with self._lock:
            self._memory.pop(key, None)
            self.from_disk.discard(key)
        if self.directory is not None:
            try:
                os.remove(os.path.join(self.directory, key + ".exe"))
            except OSError:
                pass

    def put(self, key: str, exe: Any, *, write: bool = True) -> None:
        """Keeps ``exe``; unless ``write`` is False, writes it to disk too (atomically: a
        reader never sees half)."""
        with self._lock:
            self._memory[key] = exe
            self.compiled += 1
            StepExecutables.process_compiles += 1
        if self.directory is None or not write:
            return
        from jax.experimental import serialize_executable

        try:
            payload, _, out_tree = serialize_executable.serialize(exe)
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump((payload, out_tree), f)
            os.replace(tmp, os.path.join(self.directory, key + ".exe"))
        except Exception as e:  # the cache is an optimization: serving goes on without it
            log.warning("step executable %s not written: %r", key, e)


def _prune(root: str, *, keep: int, mine: str) -> None:
    """Makes ``mine`` under ``root`` and marks it used; removes the fingerprint folders beyond
    the ``keep`` most recently used (each source change makes a new one: without this the
    folder would grow by every bucket of every version run)."""
    import shutil

    try:
        os.makedirs(mine, exist_ok=True)
        os.utime(mine)
        folders = [os.path.join(root, d) for d in os.listdir(root)]
        folders = sorted(
            (f for f in folders if os.path.isdir(f)), key=os.path.getmtime, reverse=True
        )
        for old in folders[keep:]:
            if old != mine:
                shutil.rmtree(old, ignore_errors=True)
    except OSError as e:  # a read-only or vanished cache: serving goes on without it
        log.warning("step executables under %s not pruned: %r", root, e)

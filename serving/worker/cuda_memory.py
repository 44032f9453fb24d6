"""Free device memory as the CUDA driver reports it, for allocators that report none.

XLA's BFC allocator (the default) reports ``bytes_limit`` in ``device.memory_stats()``; its VMM
allocator, which ``--xla_gpu_command_buffer_update_mode=SKIP_TEMP`` switches to, returns no
statistics at all (``None``, seen on an H200 with jax 0.11.2). The pools are then sized from
``cuMemGetInfo`` in the device's primary context: the context JAX itself runs in, so the free
bytes are what is left after the weights. Only the CUDA driver library is needed (it is on
every machine where a CUDA device works); elsewhere the answer is ``None``.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


def cuda_free_bytes(device) -> int | None:
    """Free bytes on ``device`` (a jax device) per ``cuMemGetInfo``, or None when it is not a
    CUDA device or the driver cannot tell."""
    if getattr(device, "platform", None) != "gpu":
        return None
    ordinal = getattr(device, "local_hardware_id", None)
    lib = _driver() if ordinal is not None else None
    if lib is None:
        return None
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if lib.cuDeviceGet(ctypes.byref(dev), int(ordinal)) != 0:
        return None
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
        return None
    try:
        if lib.cuCtxPushCurrent_v2(ctx) != 0:
            return None
        try:
            rc = lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(dev)
    return int(free.value) if rc == 0 else None

"""A register cap for Pallas Triton kernels, by kernel name (ptxas' ``.maxnreg``).

Pallas' Triton ``CompilerParams`` has warps and stages, no register cap; Triton's own compiler
takes one (its ``maxnreg`` option, which sets the module attribute ``ttg.maxnreg`` that its
LLVM lowering turns into the kernel's ``.maxnreg``). The intra launches of the delta-rule
prefill sit at the 255-register ceiling (BENCHMARKS.md, ncu), so an SM holds one or two of
their programs and the launch waits on latency. A cap trades spills for resident programs.

:func:`set_cap` records a cap for the kernels whose name (the ``pallas_call``'s ``name``)
starts with a prefix; the cap is written into each such kernel's Triton module when it is
lowered (:func:`install`, a wrapper around Pallas' private module lowering, installed once).
``HYJAX_TRITON_MAXNREG="prefix=N,prefix=N"`` sets caps for a process (N 0: no cap). Where
Pallas' lowering is not what this module expects (another jax), nothing is capped and one
line is logged: a cap changes speed, never results.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_CAPS: dict[str, int] = {}
_state = {"installed": False, "usable": True}


def parse_caps(text: str) -> dict[str, int]:
    """``"prefix=N,prefix=N"`` as a dict; a clear error naming the bad entry."""
    caps = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        prefix, sep, value = item.partition("=")
        if not sep or not prefix or not value.strip().isdigit():
            raise ValueError(f"register cap {item!r}: expected kernel-name-prefix=registers")
        n = int(value)
        if n and not 24 <= n <= 255:
            raise ValueError(f"register cap {item!r}: registers between 24 and 255 (or 0)")
        caps[prefix.strip()] = n
    return caps


def set_cap(prefix: str, maxnreg: int | None) -> None:
    """Cap the registers of kernels named ``prefix...`` (None or 0: no cap) from their next
    lowering on (a jitted function already compiled keeps its kernels)."""
    if maxnreg:
        parse_caps(f"{prefix}={maxnreg}")  # the range check
        _CAPS[prefix] = int(maxnreg)
    else:
        _CAPS.pop(prefix, None)
    install()


def cap_for(name: str) -> int | None:
    """The cap of kernel ``name``: the longest matching prefix's (0 there: none)."""
    hits = [p for p in _CAPS if name.startswith(p)]
    return _CAPS[max(hits, key=len)] or None if hits else None


def _capped(original):
    def lower(*args, **kwargs):
        result = original(*args, **kwargs)
        try:
            from jax._src.lib.mlir import ir

            attrs = result.module.operation.attributes
            cap = cap_for(ir.StringAttr(attrs["sym_name"]).value)
            if cap:
                with result.module.context:
                    i32 = ir.IntegerType.get_signless(32)
                    attrs["ttg.maxnreg"] = ir.IntegerAttr.get(i32, cap)
        except Exception as e:  # another jax's module: run uncapped, say so once
            if _state["usable"]:
                log.warning("Triton register caps not applied (%s): kernels run uncapped", e)
            _state["usable"] = False
        return result

    lower.hyjax_register_cap = True
    return lower


def install() -> bool:
    """Wrap Pallas' Triton module lowering once; False (one log line) where it cannot."""
    if _state["installed"]:
        return _state["usable"]
    _state["installed"] = True
    try:
        from jax._src.pallas.triton import lowering

        original = lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError) as e:
        log.warning("Triton register caps unavailable in this jax (%s): kernels run uncapped", e)
        _state["usable"] = False
        return False
    if not getattr(original, "hyjax_register_cap", False):
        lowering.lower_jaxpr_to_triton_module = _capped(original)
    return True


_CAPS.update(parse_caps(os.environ.get("HYJAX_TRITON_MAXNREG", "")))
if _CAPS:
    install()

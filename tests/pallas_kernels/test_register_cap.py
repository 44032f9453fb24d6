"""The Triton register cap (pallas_kernels.common.register_cap): parsed, looked up by name,
and written into the kernel's Triton module when it is lowered for CUDA (CPU-only)."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import register_cap


def _kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def _triton_modules(name: str) -> list[str]:
    """The Triton module text of ``pallas_call(name=name)`` lowered for CUDA: captured outside
    the cap's wrapper, as the device's compiler receives it."""
    from jax._src.pallas.triton import lowering

    texts, inner = [], lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = inner(*args, **kwargs)
        texts.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    call = pl.pallas_call(
        _kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), name=name,
        compiler_params=pltr.CompilerParams(num_warps=1),  # Triton, not Mosaic GPU
    )  # fmt: skip
    lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(call).trace(jax.ShapeDtypeStruct((16,), jnp.float32)).lower(
            lowering_platforms=("cuda",)
        )
    finally:
        lowering.lower_jaxpr_to_triton_module = inner
    return texts


@pytest.fixture
def caps():
    saved = dict(register_cap._CAPS)
    yield register_cap
    register_cap._CAPS.clear()
    register_cap._CAPS.update(saved)


def test_parse_caps_and_lookup(caps):
    assert caps.parse_caps("a=128, ab_c=96,,x=0") == {"a": 128, "ab_c": 96, "x": 0}
    for bad in ("a", "a=", "=96", "a=12x", "a=300", "a=8"):
        with pytest.raises(ValueError, match="register cap"):
            caps.parse_caps(bad)
    caps.set_cap("hyjax_probe", 168)
    caps.set_cap("hyjax_probe_intra", 128)
    caps.set_cap("hyjax_probe_intra_off", 0)  # cleared: no entry left
    assert caps.cap_for("hyjax_probe_diag_gpu") == 168
    assert caps.cap_for("hyjax_probe_intra_gpu") == 128  # the longest prefix wins
    assert caps.cap_for("other_kernel") is None
    caps.set_cap("hyjax_probe_intra", None)
    assert caps.cap_for("hyjax_probe_intra_gpu") == 168


def test_cap_reaches_the_triton_module(caps):
    caps.set_cap("hyjax_capped", 96)
    [capped] = _triton_modules("hyjax_capped_probe")
    [plain] = _triton_modules("hyjax_plain_probe")
    assert "attributes {ttg.maxnreg = 96 : i32}" in capped
    assert "maxnreg" not in plain

"""Model presets (real sizes and tiny test sizes), as named constructors of frozen configs."""

from configs.kimi_linear import kimi_linear_48b_a3b, kimi_linear_tiny
from configs.qwen3_next import qwen3_next_80b_a3b, qwen3_next_tiny

PRESETS = {
    "qwen3-next-80b-a3b": qwen3_next_80b_a3b,
    "qwen3-next-tiny": qwen3_next_tiny,
    "kimi-linear-48b-a3b": kimi_linear_48b_a3b,
    "kimi-linear-tiny": kimi_linear_tiny,
}

__all__ = [
    "PRESETS",
    "kimi_linear_48b_a3b",
    "kimi_linear_tiny",
    "qwen3_next_80b_a3b",
    "qwen3_next_tiny",
]

"""Model presets (real sizes and tiny test sizes), as named constructors of frozen configs."""

from configs.qwen3_next import qwen3_next_80b_a3b, qwen3_next_tiny

PRESETS = {
    "qwen3-next-80b-a3b": qwen3_next_80b_a3b,
    "qwen3-next-tiny": qwen3_next_tiny,
}

__all__ = ["PRESETS", "qwen3_next_80b_a3b", "qwen3_next_tiny"]

"""Model presets (real sizes and tiny test sizes): every family's named constructors of frozen
configs, in one table built from the family registry (a family lists its own presets)."""

from hyjax.models import FAMILIES
from hyjax.models.kimi_linear.config import kimi_linear_48b_a3b, kimi_linear_tiny
from hyjax.models.qwen3_next.config import qwen3_next_80b_a3b, qwen3_next_tiny

PRESETS = {name: make for family in FAMILIES.values() for name, make in family.presets.items()}

__all__ = [
    "PRESETS",
    "kimi_linear_48b_a3b",
    "kimi_linear_tiny",
    "qwen3_next_80b_a3b",
    "qwen3_next_tiny",
]

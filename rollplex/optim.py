"""The learning-rate schedule of the optimizer (the optimizer itself is memory.chunked_adamw.ChunkedAdamW)."""

from __future__ import annotations


def learning_rate(step: int, base_lr: float, warmup_steps: int) -> float:
    """Linear warm-up over ``warmup_steps`` optimizer steps, then constant ``base_lr``."""
    if warmup_steps <= 0:
        return base_lr
    return base_lr * min(1.0, (step + 1) / warmup_steps)

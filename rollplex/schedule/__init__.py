"""Phase schedules of one GRPO iteration: serial (the paper's Colocate baseline) and prefix-overlap (the
paper's Rollplex schedule; ``schedule.kind`` rollplex or auto)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollplex.config import Config
from rollplex.phases import Roles, temporal_phase, uses_temporal
from rollplex.types import RolloutBatch, ShuffledAccuracy


def make_step(cfg: Config, device: torch.device) -> Callable:
    """The step function of ``cfg.schedule.kind``: ``step(roles, prompts, timer)`` returns (scored batch,
    actor statistics, gradient norms, schedule metrics)."""
    from rollplex.schedule.prefix_overlap import PrefixOverlapSchedule
    from rollplex.schedule.serial import serial_step

    return serial_step if cfg.schedule.kind == "serial" else PrefixOverlapSchedule(cfg, device)


def shuffled_rollout(roles: Roles, rollout: RolloutBatch, timer) -> ShuffledAccuracy | None:
    """T-GRPO's shuffled-frame rollout as the "temporal" phase, right after the ordered rollout (and, in
    the rollplex schedule, after Phase 1 has joined) in every schedule; None when T-GRPO is off. Its time
    is ``time/temporal`` and enters none of Eq. 1's terms (``eq1/*``, ``eq1/T_post`` included)."""
    if not uses_temporal(roles):
        return None
    with timer.phase("temporal"):
        return temporal_phase(roles, rollout)

"""Phase schedules of one GRPO iteration: serial (the paper's Colocate baseline) and Rollplex."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollplex.config import Config


def make_step(cfg: Config, device: torch.device) -> Callable:
    """The step function of ``cfg.run.schedule``: ``step(roles, prompts, timer)`` returns (scored batch,
    actor statistics, gradient norms, schedule metrics)."""
    from rollplex.schedule.rollplex import RollplexSchedule
    from rollplex.schedule.serial import serial_step

    return serial_step if cfg.run.schedule == "serial" else RollplexSchedule(cfg, device)

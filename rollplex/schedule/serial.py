"""The serial schedule (the paper's "Colocate" baseline): phases one after another on one stream.

    rollout → [temporal] → rewards → reference → actor forward/backward → optimizer
                                                              (per mini-batch: actor, optimizer)

Barriers hold trivially: θ_k is only written by the optimizer phase, after every reader of θ_k in this
step (rollout, old log-probs, actor backward of the mini-batch) has finished.
"""

from __future__ import annotations

from rollplex.phases import (
    ActorStats,
    Roles,
    actor_backward,
    actor_old_logprobs,
    end_step,
    enter_window,
    reference_phase,
    reward_phase,
    rollout_phase,
)
from rollplex.schedule import shuffled_rollout
from rollplex.types import Prompt, ScoredBatch


def mini_batches(num_groups: int, count: int) -> list[list[int]]:
    """Split group indices 0..G-1 into ``count`` contiguous mini-batches of (nearly) equal size."""
    count = max(1, min(count, num_groups))
    bounds = [round(i * num_groups / count) for i in range(count + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(count)]


def serial_step(
    roles: Roles, prompts: list[Prompt], timer
) -> tuple[ScoredBatch, list[ActorStats], list[float], dict[str, float]]:
    """One iteration. Returns the scored batch, per-mini-batch actor statistics, gradient norms and the
    step's schedule metrics (decode time, Eq. 1's T_D, and everything after rollout, T_post; the prefixes
    are not timed apart from their suffixes here)."""
    cfg = roles.config
    enter_window(roles, "rollout")
    with timer.phase("rollout"):
        rollout = rollout_phase(roles, prompts, cfg.rollout.group_size, roles.sampling)
    shuffled = shuffled_rollout(roles, rollout, timer)
    post_start = timer.now()
    enter_window(roles, "scoring")
    with timer.phase("rewards"):
        scored = reward_phase(roles, rollout, shuffled)
    with timer.phase("reference"):
        scored = reference_phase(roles, scored)
    old_logprobs = None
    if cfg.algo.mini_batches > 1:  # else the ratio's old log-probs are the current ones (actor_backward)
        with timer.phase("actor"):
            old_logprobs = actor_old_logprobs(roles, scored)
    stats, norms = [], []
    for groups in mini_batches(len(prompts), cfg.algo.mini_batches):
        enter_window(roles, "backward")
        with timer.phase("actor"):
            stats.append(actor_backward(roles, scored, groups, old_logprobs))
        enter_window(roles, "update")
        with timer.phase("optimizer"):
            norms.append(roles.optimizer.clip_and_step(cfg.optim.max_grad_norm))
    end_step(roles)
    timeline = rollout.timeline
    return (
        scored,
        stats,
        norms,
        {"eq1/T_D": timeline.end - timeline.start, "eq1/T_post": timer.now() - post_start},
    )

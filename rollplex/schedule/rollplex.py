"""The Rollplex schedule (paper §2.3, §3.1): prompt-side work before the responses exist, suffixes after.

    Phase 1  reference prefix (detached) and actor prefix (attached), once per group, under θ_k;
             rollout decode of N responses per group — from its own rollout prefix, or, with prefill
             fusion (DESIGN.md §3.4), from the actor prefix's detached boundary (one prompt pass fewer)
    Phase 2  rewards → advantages; reference suffix scoring against the kept reference boundary;
             actor suffix + backward through the kept actor boundary into prefix, merger and vision
    Phase 3  optimizer step → θ_{k+1}

Barriers: nothing writes θ_k before Phase 3 (the optimizer is the only writer and runs after every
backward); a suffix can only start once its responses are fixed and its prefix exists, because the
suffix calls take the RolloutBatch and the PrefixState as arguments.

The update is the serial schedule's update: same θ_k, responses, prefixes and loss, so on the CPU the
parameters after any number of steps are bitwise equal to ``serial``'s (tests/schedule). This version
issues Phase 1's prefix work and decode one after the other on the current stream; running the prefixes
on a second stream inside the decode window is the next step.
"""

from __future__ import annotations

from rollplex.models.forward import detach_prefix, merge_prefixes, prefix_states
from rollplex.phases import (
    ActorStats,
    Roles,
    actor_backward,
    reference_phase,
    reward_phase,
    rollout_phase,
    uses_reference,
)
from rollplex.types import Prompt, ScoredBatch


def rollplex_step(
    roles: Roles, prompts: list[Prompt], timer
) -> tuple[ScoredBatch, list[ActorStats], list[float]]:
    """One iteration in the Rollplex order. Returns the scored batch, actor statistics, gradient norms."""
    cfg = roles.config
    kwargs = {"temperature": roles.score_temperature, "banned_ids": roles.banned_ids}
    with timer.phase("prefix"):
        reference = None
        if uses_reference(roles):
            reference = merge_prefixes(prefix_states(roles.reference, prompts, attached=False, **kwargs))
        actor = prefix_states(roles.actor, prompts, attached=True, **kwargs)
    with timer.phase("rollout"):
        seed = detach_prefix(merge_prefixes(actor)) if cfg.run.prefill_fusion else None
        rollout = rollout_phase(roles, prompts, cfg.rollout.group_size, roles.sampling, prefix=seed)
    with timer.phase("rewards"):
        scored = reward_phase(roles, rollout)
    with timer.phase("reference"):
        scored = reference_phase(roles, scored, prefix=reference)
    with timer.phase("actor"):
        stats = [actor_backward(roles, scored, list(range(len(prompts))), None, prefixes=actor)]
    with timer.phase("optimizer"):
        norms = [roles.optimizer.clip_and_step(cfg.optim.max_grad_norm)]
    return scored, stats, norms

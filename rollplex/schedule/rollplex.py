"""The Rollplex schedule (paper §2.3, §3.1): prompt-side work inside the decode window, suffixes after.

    Phase 1  rollout decode of N responses per group (critical path, main thread), from its own rollout
             prefix — or, with prefill fusion (DESIGN.md §3.4), from the actor prefix's detached boundary
             (one prompt pass fewer);
             concurrently (``run.overlap``, schedule.concurrency): reference prefix (detached) and actor
             prefix (attached) once per group under θ_k, on a worker thread and its own CUDA stream
    Phase 2  rewards → advantages; reference suffix scoring against the kept reference boundary;
             actor suffix + backward through the kept actor boundary into prefix, merger and vision
    Phase 3  optimizer step → θ_{k+1}

Barriers: nothing writes θ_k before Phase 3 (the optimizer is the only writer and runs after every
backward); a suffix can only start once its responses are fixed and its prefix exists: the suffix calls
take the RolloutBatch and the joined worker's PrefixStates as arguments.

The update is the serial schedule's update: same θ_k, responses, prefixes and loss, so on the CPU the
parameters after any number of steps are bitwise equal to ``serial``'s (tests/schedule).
"""

from __future__ import annotations

import time

import torch

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
from rollplex.schedule.concurrency import SideResult, SideWork, stream_sync
from rollplex.types import PrefixState, Prompt, RolloutBatch, ScoredBatch

Prefixes = tuple[PrefixState | None, list[PrefixState] | None]


def _prefixes(roles: Roles, prompts: list[Prompt], actor: bool) -> Prefixes:
    """Phase-1 prompt work: the merged reference prefix (or None without KL) and, if ``actor``, the
    attached actor prefix of every group."""
    kwargs = {"temperature": roles.score_temperature, "banned_ids": roles.banned_ids}
    reference = None
    if uses_reference(roles):
        reference = merge_prefixes(prefix_states(roles.reference, prompts, attached=False, **kwargs))
    actor_states = prefix_states(roles.actor, prompts, attached=True, **kwargs) if actor else None
    return reference, actor_states


def _boundary_tensors(result: SideResult) -> list:
    reference, actor = result.value
    states = ([reference] if reference is not None else []) + (actor or [])
    return [t for s in states for t in (*s.keys, *s.values, s.last_logprobs, s.prompt_lens, s.next_position)]


def phase1(
    roles: Roles, prompts: list[Prompt], timer
) -> tuple[RolloutBatch, PrefixState | None, list[PrefixState]]:
    """Rollout plus the reference and actor prefixes; returns (rollout, reference prefix, actor prefixes)."""
    cfg, device = roles.config, roles.banned_ids.device
    actor, seed = None, None
    if cfg.run.prefill_fusion:
        with timer.phase("prefix"):
            kwargs = {"temperature": roles.score_temperature, "banned_ids": roles.banned_ids}
            actor = prefix_states(roles.actor, prompts, attached=True, **kwargs)
        with torch.no_grad():
            seed = merge_prefixes([detach_prefix(state) for state in actor])
    side = lambda: _prefixes(roles, prompts, actor=actor is None)  # noqa: E731
    n, sampling = cfg.rollout.group_size, roles.sampling
    if not cfg.run.overlap:
        with timer.phase("prefix"):
            reference, side_actor = side()
        with timer.phase("rollout"):
            rollout = rollout_phase(roles, prompts, n, sampling, prefix=seed)
        return rollout, reference, actor if actor is not None else side_actor
    start = timer.now()
    worker = SideWork(side, device).start()
    try:
        rollout = rollout_phase(roles, prompts, n, sampling, prefix=seed)
    except BaseException:
        worker.wait()  # never leave prefix work running against θ_k behind an error
        raise
    stream_sync(device)
    decode_end = time.perf_counter()
    result = worker.join(_boundary_tensors)
    timer.record("rollout", start, decode_end, "decode")
    timer.record("prefix", result.start, result.end, "prefix")
    reference, side_actor = result.value
    return rollout, reference, actor if actor is not None else side_actor


def rollplex_step(
    roles: Roles, prompts: list[Prompt], timer
) -> tuple[ScoredBatch, list[ActorStats], list[float]]:
    """One iteration in the Rollplex order. Returns the scored batch, actor statistics, gradient norms."""
    cfg = roles.config
    rollout, reference, actor = phase1(roles, prompts, timer)
    with timer.phase("rewards"):
        scored = reward_phase(roles, rollout)
    with timer.phase("reference"):
        scored = reference_phase(roles, scored, prefix=reference)
    with timer.phase("actor"):
        stats = [actor_backward(roles, scored, list(range(len(prompts))), None, prefixes=actor)]
    with timer.phase("optimizer"):
        norms = [roles.optimizer.clip_and_step(cfg.optim.max_grad_norm)]
    return scored, stats, norms

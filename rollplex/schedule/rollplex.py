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


def _actor_prefixes(roles: Roles, prompts: list[Prompt]) -> list[PrefixState]:
    """The attached actor prefix of every group under θ_k."""
    return prefix_states(
        roles.actor, prompts, temperature=roles.score_temperature, banned_ids=roles.banned_ids, attached=True
    )


def _prefixes(roles: Roles, prompts: list[Prompt], actor: bool) -> Prefixes:
    """Phase-1 prompt work: the merged reference prefix (or None without KL) and, if ``actor``, the
    attached actor prefix of every group."""
    reference = None
    if uses_reference(roles):
        states = prefix_states(
            roles.reference,
            prompts,
            temperature=roles.score_temperature,
            banned_ids=roles.banned_ids,
            attached=False,
        )
        reference = merge_prefixes(states)
    return reference, _actor_prefixes(roles, prompts) if actor else None


def _boundary_tensors(result: SideResult) -> list:
    reference, actor = result.value
    states = ([reference] if reference is not None else []) + (actor or [])
    return [t for s in states for t in (*s.keys, *s.values, s.last_logprobs, s.prompt_lens, s.next_position)]


def _decode_with_side_work(
    roles: Roles, prompts: list[Prompt], seed, side, timer
) -> tuple[RolloutBatch, Prefixes]:
    """Decode on the main thread while ``side()`` runs on the worker (``run.overlap``), or one after the
    other; returns the rollout and what ``side()`` produced."""
    cfg, device = roles.config, roles.banned_ids.device
    n, sampling = cfg.rollout.group_size, roles.sampling
    if not cfg.run.overlap:
        with timer.phase("prefix"):
            prefixes = side()
        with timer.phase("rollout"):
            return rollout_phase(roles, prompts, n, sampling, prefix=seed), prefixes
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
    return rollout, result.value


def phase1(
    roles: Roles, prompts: list[Prompt], timer
) -> tuple[RolloutBatch, PrefixState | None, list[PrefixState]]:
    """Rollout plus the reference and actor prefixes; returns (rollout, reference prefix, actor prefixes)."""
    fused, seed = None, None
    if roles.config.run.prefill_fusion:
        with timer.phase("prefix"):
            fused = _actor_prefixes(roles, prompts)
        with torch.no_grad():
            seed = merge_prefixes([detach_prefix(state) for state in fused])
    side = lambda: _prefixes(roles, prompts, actor=fused is None)  # noqa: E731
    rollout, (reference, actor) = _decode_with_side_work(roles, prompts, seed, side, timer)
    return rollout, reference, fused if fused is not None else actor


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

"""The phases of one synchronous GRPO iteration (docs/architecture.md), each a function of typed inputs.

    rollout    rollout prefix (detached, θ_k) → decode N responses per group
    temporal   (T-GRPO only) decode M responses per video group from its shuffled-frame twin
    rewards    reward functions (+ T-GRPO bonus) → group advantages
    reference  reference prefix (detached) + suffix scoring → ref log-probs
    actor      actor prefix (attached) + suffix → GRPO loss → backward
    optimizer  clip + AdamW → θ_{k+1}

Every role computes its prompt prefix once per group (models.forward). Schedules (schedule/) decide
the order and concurrency of these calls; the functions themselves never synchronise the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from rollplex.algo.advantages import group_advantages
from rollplex.algo.kl import kl_penalty
from rollplex.algo.losses import aggregate, policy_loss
from rollplex.algo.rewards import accuracy_range, add_temporal_bonus, compute_rewards, temporal_reward_name
from rollplex.config import Config, reward_weights, temporal_samples
from rollplex.memory.chunked_adamw import ChunkedAdamW
from rollplex.memory.residency import Residency
from rollplex.memory.saved_offload import SavedTensorOffload
from rollplex.models.attention import SuffixAttention
from rollplex.models.forward import (
    AUTO_SUFFIX_ATTENTION,
    detach_prefix,
    merge_prefixes,
    prefix_forward,
    prefix_states,
    suffix_logprobs,
)
from rollplex.models.transfer import to_device
from rollplex.rollout.engine import SamplingParams, generate
from rollplex.types import PrefixState, Prompt, RolloutBatch, ScoredBatch, ShuffledAccuracy

if TYPE_CHECKING:
    from rollplex.parallel.runtime import ParallelRuntime

log = logging.getLogger(__name__)


@dataclass
class Roles:
    """What the phases run on: the actor (trained, also read by rollout), the frozen reference, the
    optimizer, the tokenizer, sampling settings and the sampling generator; where state lives:
    ``residency`` (memory.residency: the reference paged around the windows that read it; None = every
    class resident, nothing moved) and ``offload`` (memory.saved_offload: the actor prefixes' saved
    tensors in the host pool between Phase 1 and their backward; None = kept on the device); under
    torchrun, this rank's part of the parallel run (``parallel``: its rollout engines and data-parallel
    counts; None in one process)."""

    actor: torch.nn.Module
    reference: torch.nn.Module | None
    optimizer: ChunkedAdamW
    tokenizer: object
    sampling: SamplingParams
    generator: torch.Generator
    config: Config
    residency: Residency | None = None
    offload: SavedTensorOffload | None = None
    parallel: ParallelRuntime | None = None

    @property
    def banned_ids(self) -> torch.Tensor:
        return self.sampling.banned_ids

    @property
    def score_temperature(self) -> float:
        """Temperature of the log-prob definition (1.0 when rollout is greedy)."""
        return self.sampling.score_temperature

    @property
    def suffix_attention(self) -> SuffixAttention:
        """How scored responses attend to their prompt's keys (``model.suffix_attention`` and
        ``model.cascade_kernels``)."""
        model = self.config.model
        return SuffixAttention(model.suffix_attention, model.cascade_kernels)


def rollout_prefix(roles: Roles, prompts: list[Prompt], sampling: SamplingParams) -> PrefixState | None:
    """The rollout prefix of ``prompts`` under θ_k: detached, last-position log-probs at the sampling
    temperature (1 when greedy). None on a rank that does not decode (a disaggregated training rank:
    the rollout GPUs prefill their own groups)."""
    if roles.parallel is not None and not roles.parallel.decodes_here:
        return None
    return prefix_forward(
        roles.actor,
        prompts,
        temperature=sampling.score_temperature,
        banned_ids=roles.banned_ids,
        attached=False,
    )


def enter_window(roles: Roles, window: str) -> None:
    """The step enters ``window`` (memory.windows: rollout, scoring, backward, update): the residency
    manager pages state in or out as its plan says (no-op without one)."""
    if roles.residency is not None:
        roles.residency.enter(window)


def end_step(roles: Roles) -> None:
    """The step is over: the host pool's per-step arenas are reused by the next one."""
    if roles.residency is not None:
        roles.residency.end_step()


def _reference_ready(roles: Roles) -> None:
    """Order the current stream after the reference's page-in, where it is paged (before its first read)."""
    if roles.residency is not None and "reference" in roles.residency.pages:
        roles.residency.wait("reference")


def actor_prefixes(roles: Roles, prompts: list[Prompt], first: int = 0) -> list[PrefixState]:
    """The attached actor prefix of every group under θ_k, one state per group (each with its own graph,
    so a micro-batch's backward reaches only its groups' prefixes). With ``roles.offload``, what each
    group's prefix saves for its backward goes to the host pool as it is produced, under the group's
    index in the step (``first`` + its position in ``prompts``); ``actor_backward`` brings it back."""
    if roles.offload is None:
        return _group_prefixes(roles, roles.actor, prompts, attached=True)
    states = []
    for g, prompt in enumerate(prompts, start=first):
        with roles.offload.group(g):
            states += _group_prefixes(roles, roles.actor, [prompt], attached=True)
    return states


def reference_prefixes(roles: Roles, prompts: list[Prompt]) -> list[PrefixState]:
    """The detached reference prefix of every group, one state per group."""
    _reference_ready(roles)
    return _group_prefixes(roles, roles.reference, prompts, attached=False)


def _group_prefixes(roles: Roles, model, prompts: list[Prompt], attached: bool) -> list[PrefixState]:
    temperature, banned = roles.score_temperature, roles.banned_ids
    return prefix_states(model, prompts, temperature=temperature, banned_ids=banned, attached=attached)


def merged_reference(states: list[PrefixState]) -> PrefixState | None:
    """The groups' reference prefixes as one PrefixState for ``reference_phase``; None without any (no
    reference scoring)."""
    return merge_prefixes(states) if states else None


def decode_seed(actor: list[PrefixState]) -> PrefixState:
    """Prefill fusion: the actor prefixes' boundaries, detached and merged, from which decode starts (the
    rollout prefix it replaces is the same prompt pass under the same θ_k)."""
    with torch.no_grad():
        return merge_prefixes([detach_prefix(state) for state in actor])


def rollout_phase(
    roles: Roles,
    prompts: list[Prompt],
    group_size: int,
    sampling: SamplingParams,
    prefix: PrefixState | None = None,
    before_decode: Callable[[], None] | None = None,
) -> RolloutBatch:
    """N samples per prompt under θ_k, from ``prefix`` (a detached boundary, e.g. the actor's under
    prefill fusion) or from a rollout prefix computed here (no graph); ``before_decode`` runs once the
    decode step is ready (rollout.engine.generate). Under torchrun this rank's rollout engine decodes its
    groups and the replica's responses come back (parallel.engines)."""
    if roles.parallel is not None:
        kwargs = {"tokenizer": roles.tokenizer, "generator": roles.generator, "before_decode": before_decode}
        return roles.parallel.rollout(
            roles.actor, prompts, prefix, group_size=group_size, params=sampling, **kwargs
        )
    if prefix is None:
        prefix = rollout_prefix(roles, prompts, sampling)
    return generate(
        roles.actor,
        prompts,
        prefix,
        group_size=group_size,
        params=sampling,
        tokenizer=roles.tokenizer,
        generator=roles.generator,
        before_decode=before_decode,
    )


def uses_temporal(roles: Roles) -> bool:
    """Whether T-GRPO's shuffled-frame rollout runs (``reward.temporal_alpha`` > 0)."""
    return roles.config.reward.temporal_alpha > 0


def temporal_phase(roles: Roles, rollout: RolloutBatch) -> ShuffledAccuracy:
    """T-GRPO's shuffled-frame rollout (Video-R1, Feng et al. 2025; docs/video-r1-format.md, "Rewards"): M
    responses under θ_k (``reward.temporal_samples``) for each group whose prompt has a shuffled twin
    (``Prompt.shuffled``), scored with the compared reward (``reward.temporal_reward``, else the run's first
    built-in accuracy reward: ``temporal_reward_name``). Runs after the ordered rollout, so every schedule
    draws from the sampling generator in the same order."""
    cfg = roles.config
    m = temporal_samples(cfg.reward, rollout.group_size)
    name = temporal_reward_name(cfg.reward.functions, cfg.reward.temporal_reward)  # the config checks it
    groups = [g for g, prompt in enumerate(rollout.prompts) if prompt.shuffled is not None]
    twins = [rollout.prompts[g].shuffled for g in groups]
    if groups or roles.parallel is not None:  # under torchrun every rank joins, groups or not
        shuffled = rollout_phase(roles, twins, m, roles.sampling)
    if not groups:
        return ShuffledAccuracy([], torch.zeros(0, m), reward=name)
    records = [p.record for p in twins for _ in range(m)]
    rewards = compute_rewards(shuffled.texts, records, [name], rows="shuffled-frame row")
    values, outside = accuracy_range(rewards.per_function[name])
    if outside:
        log.warning(
            "%d shuffled-frame values of reward %s outside [0, 1] or NaN: clipped, counted", outside, name
        )
    return ShuffledAccuracy(groups, values.view(len(groups), m), rewards.errors + outside, reward=name)


def reward_phase(
    roles: Roles, rollout: RolloutBatch, shuffled: ShuffledAccuracy | None = None
) -> ScoredBatch:
    """Rewards of every response, with T-GRPO's bonus when ``shuffled`` is given, and group advantages
    (reference log-probs are filled in later)."""
    cfg = roles.config
    records = [p.record for p in rollout.prompts for _ in range(rollout.group_size)]
    names, weights = list(cfg.reward.functions), reward_weights(cfg.reward)
    rewards = compute_rewards(rollout.texts, records, names, weights)
    if shuffled is not None:
        alpha, mu = cfg.reward.temporal_alpha, cfg.reward.temporal_mu
        weight = weights[names.index(shuffled.reward)]  # the reward temporal_phase scored with
        rewards = add_temporal_bonus(rewards, shuffled, rollout.group_size, alpha, mu, weight)
    advantages, zero_groups = group_advantages(rewards.total, rollout.group_size, cfg.algo.normalize_std)
    advantages = advantages.to(rollout.responses.device)
    return ScoredBatch(rollout, rewards, advantages, zero_groups, ref_logprobs=None, shuffled=shuffled)


def score(
    model,
    prompts: list[Prompt],
    rollout: RolloutBatch,
    temperature: float,
    banned_ids,
    prefix: PrefixState | None = None,
    attention: SuffixAttention = AUTO_SUFFIX_ATTENTION,
) -> torch.Tensor:
    """Detached log-probs float32 [B, R] of the rollout's responses under ``model``: suffixes against
    ``prefix`` (computed here when None), with the suffix ``attention``."""
    with torch.no_grad():
        if prefix is None:
            prefix = prefix_forward(
                model, prompts, temperature=temperature, banned_ids=banned_ids, attached=False
            )
        logprobs, _ = suffix_logprobs(
            model,
            prefix,
            rollout.responses,
            group_size=rollout.group_size,
            temperature=temperature,
            banned_ids=banned_ids,
            attention=attention,
        )
    return torch.where(rollout.response_mask(), logprobs, 0.0)


def reference_phase(roles: Roles, scored: ScoredBatch, prefix: PrefixState | None = None) -> ScoredBatch:
    """Reference log-probs of the responses (skipped when the KL coefficient is 0), against the
    reference ``prefix`` when it was computed earlier."""
    if not uses_reference(roles):
        return scored
    _reference_ready(roles)
    rollout = scored.rollout
    scored.ref_logprobs = score(
        roles.reference,
        rollout.prompts,
        rollout,
        roles.score_temperature,
        roles.banned_ids,
        prefix,
        roles.suffix_attention,
    )
    return scored


def uses_reference(roles: Roles) -> bool:
    """Whether reference scoring runs (a reference model and a non-zero KL coefficient)."""
    return roles.reference is not None and roles.config.algo.kl_coef != 0


@dataclass
class ActorStats:
    """Sums over the micro-batches of one mini-batch."""

    loss: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    entropy: float = 0.0
    logprob_diff_max: float = 0.0
    logprob_diff_sum: float = 0.0
    tokens: int = 0


def _group_slices(groups: list[int], size: int) -> list[list[int]]:
    size = size if size > 0 else len(groups)
    return [groups[i : i + size] for i in range(0, len(groups), size)]


def actor_backward(
    roles: Roles,
    scored: ScoredBatch,
    groups: list[int],
    old_logprobs: torch.Tensor | None,
    prefixes: list[PrefixState] | None = None,
) -> ActorStats:
    """Forward + backward of the GRPO loss over ``groups`` (one mini-batch), micro-batched by groups.

    The loss of each micro-batch is normalised by the mini-batch's valid-token and sequence counts, so
    the accumulated gradient equals the full mini-batch gradient (field case B11).

    Args:
        old_logprobs: float32 [B, R] behaviour log-probs, or None for the first (on-policy) update, where
            the detached current log-probs are used so the ratio is exactly 1.
        prefixes: the attached actor prefix of every group, computed earlier (rollplex schedule), or
            None to compute each micro-batch's prefix here. Where ``roles.offload`` holds their saved
            tensors, each micro-batch's come back to the device ahead of its backward (the next
            micro-batch's are fetched while this one's backward runs) and are forgotten after it.
    """
    cfg, rollout = roles.config, scored.rollout
    n, mask = rollout.group_size, rollout.response_mask()
    rows_all = [g * n + i for g in groups for i in range(n)]
    num_tokens, num_seqs = int(mask[rows_all].sum()), len(rows_all)
    if roles.parallel is not None:  # every replica's loss over the whole batch's counts (B11 across GPUs)
        num_tokens, num_seqs = roles.parallel.global_counts(num_tokens, num_seqs)
    sums = torch.zeros(len(_SUM_FIELDS), dtype=torch.float64, device=mask.device)
    micros = _group_slices(groups, cfg.algo.micro_batch_groups)
    offload = roles.offload if prefixes is not None else None
    _prefetch(offload, micros[0] if micros else [])
    for index, micro in enumerate(micros):
        rows = to_device(torch.tensor([g * n + i for g in micro for i in range(n)]), mask.device)
        if prefixes is None:
            prefix = prefix_forward(
                roles.actor,
                [rollout.prompts[g] for g in micro],
                temperature=roles.score_temperature,
                banned_ids=roles.banned_ids,
                attached=True,
            )
        else:
            prefix = merge_prefixes([prefixes[g] for g in micro])
        logprobs, entropy = suffix_logprobs(
            roles.actor,
            prefix,
            rollout.responses[rows],
            group_size=n,
            temperature=roles.score_temperature,
            banned_ids=roles.banned_ids,
            with_entropy=True,
            attention=roles.suffix_attention,
        )
        m = mask[rows]
        old = logprobs.detach() if old_logprobs is None else old_logprobs[rows]
        loss_tok, clipped = policy_loss(
            logprobs, old, scored.advantages[rows], cfg.algo.clip_low, cfg.algo.clip_high
        )
        kl = torch.zeros_like(loss_tok)
        if scored.ref_logprobs is not None:
            kl = kl_penalty(
                logprobs, scored.ref_logprobs[rows], cfg.algo.kl_estimator, cfg.algo.kl_log_ratio_bound
            )
            loss_tok = loss_tok + cfg.algo.kl_coef * kl
        loss = aggregate(
            loss_tok,
            m,
            cfg.algo.loss_agg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            horizon=cfg.rollout.max_response_tokens,
        )
        _prefetch(offload, micros[index + 1] if index + 1 < len(micros) else [])
        loss.backward()
        _release(offload, micro)
        # The rollout-vs-trainer gap compares log-probs under θ_k (the behaviour log-probs when a previous
        # mini-batch has already updated the actor).
        part = _micro_sums(loss, kl, clipped, entropy, old.detach(), rollout.logprobs[rows], m)
        sums = _add_sums(sums, part)
    return _stats(sums)


def _prefetch(offload: SavedTensorOffload | None, groups: list[int]) -> None:
    """Start bringing ``groups``' offloaded prefix tensors back to the device (no-op without offload)."""
    for g in groups if offload is not None else ():
        offload.prefetch(g)


def _release(offload: SavedTensorOffload | None, groups: list[int]) -> None:
    for g in groups if offload is not None else ():
        offload.release(g)


# _micro_sums' vector holds the ActorStats fields in their declared order; logprob_diff_max is a
# maximum, the rest sums
_SUM_FIELDS = tuple(f.name for f in fields(ActorStats))
_MAX_FIELD = _SUM_FIELDS.index("logprob_diff_max")


def _micro_sums(loss, kl, clipped, entropy, logprobs, rollout_logprobs, mask) -> torch.Tensor:
    """One micro-batch's masked sums, float64 [7] on the device in ``_SUM_FIELDS`` order: each is
    reduced in its own dtype and widened, as ``float()`` of it would be, so the host reads them once
    per mini-batch instead of seven times per micro-batch (each read drains the device queue).

    Args:
        loss: scalar; kl, entropy, logprobs, rollout_logprobs: float [b, R]; clipped, mask: bool [b, R].
    """
    diff = torch.where(mask, (logprobs - rollout_logprobs).abs(), 0.0)
    dmax = diff.max() if diff.numel() else diff.new_zeros(())
    values = (
        loss.detach(),
        torch.where(mask, kl.detach(), 0.0).sum(),
        (clipped & mask).sum(),
        torch.where(mask, entropy.detach(), 0.0).sum(),
        dmax,
        diff.sum(),
        mask.float().sum(),
    )
    return torch.stack([v.to(torch.float64) for v in values])


def _add_sums(sums: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``sums`` + ``part`` (float64 [7]), the maximum field by ``fmax``: a NaN maximum of a micro-batch
    leaves the running one as it was, as Python's ``max(running, nan)`` did when the host summed."""
    total = sums + part
    total[_MAX_FIELD] = torch.fmax(sums[_MAX_FIELD], part[_MAX_FIELD])
    return total


def _stats(sums: torch.Tensor) -> ActorStats:
    """``ActorStats`` from a mini-batch's ``_micro_sums`` totals (one read of the device)."""
    values = dict(zip(_SUM_FIELDS, sums.tolist()))
    return ActorStats(**{**values, "tokens": int(values["tokens"])})


def actor_old_logprobs(roles: Roles, scored: ScoredBatch) -> torch.Tensor:
    """Behaviour log-probs float32 [B, R] under θ_k, for steps of several updates (with one update per
    batch the caller passes None to ``actor_backward`` instead: the ratio's old log-probs are then the
    current ones, detached)."""
    rollout = scored.rollout
    return score(
        roles.actor,
        rollout.prompts,
        rollout,
        roles.score_temperature,
        roles.banned_ids,
        attention=roles.suffix_attention,
    )

"""The one definition of a token log-prob, and the sampler built on it.

Rollout recording, reference scoring and actor scoring all use this definition (field case B08) —
:func:`token_logprobs` itself, or in rollout the fused race of rollout.sample_kernel, which computes the
same formula with float32 rounding of its own:

    logprob(token) = log_softmax(masked_logits(logits) / T)[token]   over the FULL vocabulary.

Top-k / top-p only restrict the set the sampler draws from; they never renormalise the recorded
log-prob. The five vision special ids are banned (set to -inf) in both places, so the policy can
never emit a placeholder that would later be re-embedded as a vision slot (field case B05).

Shapes: B rows being decoded, V vocabulary size, ``...`` any leading dims.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NEG_INF = float("-inf")


def masked_logits(logits: torch.Tensor, banned_ids: torch.Tensor) -> torch.Tensor:
    """Copy of ``logits`` with the banned vocabulary ids set to -inf.

    Args:
        logits: float [..., V], any float dtype, nats (unnormalised).
        banned_ids: int64 [K] vocabulary ids that must never be sampled (K may be 0), on the device of
            ``logits``; for Qwen2.5-VL the vision specials 151652..151656 (field case B05).

    Returns:
        float [..., V], same dtype as ``logits``; differentiable, the banned entries get gradient 0.

    Raises:
        ValueError: ``banned_ids`` is not a 1-D int64 tensor.
    """
    if banned_ids.dtype != torch.int64 or banned_ids.dim() != 1:
        raise ValueError(
            f"banned_ids must be a 1-D int64 tensor, got dtype={banned_ids.dtype} shape={tuple(banned_ids.shape)}"
        )
    return logits.index_fill(-1, banned_ids, NEG_INF)


def token_logprobs(logits: torch.Tensor, temperature: float, banned_ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of every vocabulary entry under the trainer's definition.

    Definition (field case B08): ``log_softmax(masked_logits(logits) / T)`` over the full
    vocabulary, computed in float32 (float64 when the logits are float64, for the oracle tests). Dividing the logits (not the log-probs) by T is what the
    sampling distribution is; no top-k / top-p renormalisation.

    Example: logits [2, 1, 0, -1], T = 0.6 -> [-0.2081, -1.8747, -3.5414, -5.2081].

    Args:
        logits: float [..., V] raw model logits (any float dtype).
        temperature: T > 0.
        banned_ids: int64 [K] ids that get log-prob -inf (see :func:`masked_logits`).

    Returns:
        float32 [..., V] (float64 for float64 logits), nats; banned entries are -inf.

    Raises:
        ValueError: ``temperature`` is not > 0, or ``banned_ids`` is malformed.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    scaled = masked_logits(logits, banned_ids).to(dtype) / temperature
    return torch.log_softmax(scaled, dim=-1)


def support_mask(logprobs: torch.Tensor, *, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Which tokens the sampler may draw: top-k first, then top-p (nucleus) on the renormalised rest.

    Order and rule follow HF ``TopKLogitsWarper`` then ``TopPLogitsWarper``: top-k keeps every token
    whose log-prob is >= the k-th largest (ties at the boundary are all kept); top-p then sorts the
    kept tokens by probability and keeps the shortest prefix whose mass reaches ``top_p`` (a token is
    kept iff the mass strictly before it is < top_p, so the most likely token is always kept).

    Example: log-probs of logits [2, 1, 0, -1] at T = 0.6 with top_p 0.9 -> kept {0, 1}, kept mass
    0.96555 (field case B08).

    Args:
        logprobs: float32 [B, V] from :func:`token_logprobs`.
        top_p: in (0, 1]; 1.0 disables nucleus filtering.
        top_k: >= 0; 0 disables top-k.

    Returns:
        bool [B, V], True where the token may be sampled. Banned (-inf) tokens are never kept unless
        a row has fewer finite entries than the filters require, which cannot happen for a real model.

    Raises:
        ValueError: ``top_p`` outside (0, 1] or ``top_k`` negative.
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    keep = torch.isfinite(logprobs)
    if 0 < top_k < logprobs.shape[-1]:
        kth = torch.topk(logprobs, top_k, dim=-1).values[..., -1:]
        keep = keep & (logprobs >= kth)
    if top_p < 1.0:
        keep = keep & _nucleus(logprobs.masked_fill(~keep, NEG_INF), top_p)
    return keep


def _nucleus(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """bool [B, V]: top-p keep mask of the distribution renormalised over the finite entries."""
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    probs = torch.softmax(sorted_lp, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep_sorted = mass_before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    banned_ids: torch.Tensor,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    race: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and record its log-prob under the trainer's definition.

    Sampling is an exponential race on the device (no host sync): token = argmax over the kept set of
    log p_T(v) - log E_v with E_v ~ Exp(1) i.i.d., which draws v with probability proportional to
    p_T(v) over the kept set (Gumbel-max). ``temperature == 0`` is greedy argmax of the masked logits.

    Recorded log-prob: ``token_logprobs(logits, T, banned_ids)`` at the drawn token, over the full
    vocabulary, NOT renormalised over the top-k / top-p set; at temperature 0 it is taken at T = 1.0.

    Args:
        logits: float [B, V] raw logits of the next position.
        temperature: T >= 0 (0 = greedy).
        banned_ids: int64 [K] ids that are never drawn (vision specials, field case B05).
        top_p: in (0, 1], 1.0 = off. top_k: >= 0, 0 = off. Both ignored when greedy.
        generator: random source on the device of ``logits``; None uses the global one.
        race: :func:`race_tokens` or a function of the same contract (rollout.sample_kernel.fused_race);
            None: ``race_tokens``.

    Returns:
        (tokens int64 [B], logprobs float32 [B] in nats).

    Raises:
        ValueError: negative temperature, ``logits`` not 2-D, or a bad top_p / top_k.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    noise = None
    if temperature > 0:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        noise = torch.empty(logits.shape, dtype=dtype, device=logits.device).exponential_(generator=generator)
    race = race or race_tokens
    return race(logits, noise, temperature=temperature, banned_ids=banned_ids, top_p=top_p, top_k=top_k)


def race_tokens(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    *,
    temperature: float,
    banned_ids: torch.Tensor,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic part of :func:`sample_tokens`, given the race's noise: a pure function of its
    tensors, so it can be compiled and captured.

    Args:
        logits: float [B, V]. noise: E_v ~ Exp(1) i.i.d., float32 [B, V] (float64 for float64 logits);
            None when greedy (``temperature == 0``). Other arguments as in :func:`sample_tokens`.

    Returns:
        (tokens int64 [B], logprobs float32 [B] in nats), as :func:`sample_tokens`.
    """
    if noise is None:
        logprobs = token_logprobs(logits, 1.0, banned_ids)
        tokens = logprobs.argmax(dim=-1)
    else:
        logprobs = token_logprobs(logits, temperature, banned_ids)
        keep = support_mask(logprobs, top_p=top_p, top_k=top_k)
        tokens = torch.where(keep, logprobs - noise.log(), NEG_INF).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of each distribution, -sum_v p(v) log p(v), in nats.

    Entries with log-prob -inf (banned ids) contribute exactly 0 to the value and the gradient (no
    0 * inf NaN). Pass the output of :func:`token_logprobs` to get the entropy of the trainer's
    (temperature-scaled, banned-masked) distribution.

    Args:
        logprobs: float [..., V], normalised log-probs.

    Returns:
        float [...], same dtype as ``logprobs``.
    """
    finite = logprobs.masked_fill(torch.isneginf(logprobs), 0.0)
    return -(logprobs.exp() * finite).sum(dim=-1)

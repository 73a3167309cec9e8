"""The sampler built on the one token log-prob definition (models.logprobs, field case B08).

Rollout records each drawn token's log-prob as :func:`models.logprobs.token_logprobs` defines it, over
the FULL vocabulary; top-k / top-p only restrict the set the sampler draws from, they never renormalise
the recorded log-prob. Banned ids (the vision specials, field case B05) are never drawn.

Shapes: B rows being decoded, V vocabulary size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollplex.models.logprobs import NEG_INF, token_logprobs


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


def sample_rows(
    logits: torch.Tensor,
    *,
    rows: tuple[int, int],
    vocab: int,
    temperature: float,
    generator: torch.Generator | None,
    race: Callable,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` for rows [first, first + B) of a batch of ``total`` rows sampled across
    several processes (``rows`` = (first, total)): the noise of all ``total`` rows, [total, V], is drawn
    from ``generator`` as one process would draw it for the whole batch, and this process races its
    rows. Each process therefore samples the tokens one process would sample for these rows, and every
    process's generator advances alike. With ``rows`` = (0, B) this is :func:`sample_tokens`.

    Args:
        logits: float [B, V] (or [B, V/tp], a vocabulary shard, with a ``race`` that takes the full
            noise, parallel.vocab_parallel). vocab: V, the noise's width.
        race: :func:`race_tokens` or a function of its contract. Other arguments: :func:`sample_tokens`.

    Returns:
        (tokens int64 [B], logprobs float32 [B] in nats).

    Raises:
        ValueError: negative temperature.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    noise = None
    if temperature > 0:
        first, total = rows
        dtype = torch.promote_types(logits.dtype, torch.float32)
        drawn = torch.empty((total, vocab), dtype=dtype, device=logits.device).exponential_(
            generator=generator
        )
        noise = drawn[first : first + logits.shape[0]]
    return race(logits, noise, temperature=temperature, **options)


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

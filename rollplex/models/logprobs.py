"""The one definition of a token log-prob, and the entropy of that distribution.

Rollout recording, reference scoring and actor scoring all use this definition (field case B08) —
:func:`token_logprobs` itself, or in rollout the fused race of rollout.sample_kernel, which computes the
same formula with float32 rounding of its own:

    logprob(token) = log_softmax(masked_logits(logits) / T)[token]   over the FULL vocabulary.

Top-k / top-p only restrict the set the sampler draws from (rollout.sampler); they never renormalise
the recorded log-prob. The five vision special ids are banned (set to -inf) in both places, so the
policy can never emit a placeholder that would later be re-embedded as a vision slot (field case B05).

Shapes: V vocabulary size, ``...`` any leading dims.
"""

from __future__ import annotations

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

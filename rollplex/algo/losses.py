"""GRPO token loss: clipped surrogate, KL term, masked aggregation and masked statistics.

Sources: PPO clipped surrogate (Schulman et al. 2017, Eq. 7); separate lower / upper clip ranges
("clip-higher", DAPO, Yu et al. 2025 §3.1); GRPO objective with a per-token k3 KL term (DeepSeekMath
§4.1, Eq. 3); aggregation modes and their denominators as in verl ``agg_loss`` (field case B11).

Shapes: B response rows, R response budget. ``mask`` is bool [B, R], True at real response tokens
(``RolloutBatch.response_mask()``). Every masked position contributes exactly 0 to values and
gradients, even if the per-token loss there is inf or NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rollplex.algo.kl import kl_penalty

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    *,
    log_ratio_bound: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate loss with asymmetric clipping.

    Definition: ratio = exp(clamp(logp - old_logp, ±log_ratio_bound)),
        loss = -min(ratio · A, clip(ratio, 1 - clip_low, 1 + clip_high) · A)
    A token is "clipped" when the clipped term is strictly the one selected (then its gradient is 0).
    At logprobs == old_logprobs the ratio is exactly 1, loss = -A and nothing is clipped. The log-ratio
    bound keeps the ratio finite at padded positions, so masking them cannot produce 0 · inf = NaN.

    Example: logp - old = log 1.5, A = +1, clip 0.2 / 0.28 -> loss -1.28, clipped; A = -1 -> loss 1.5.

    Args:
        logprobs: float32 [B, R], current policy log-probs (with gradient), nats.
        old_logprobs: float32 [B, R], log-probs recorded at sampling (same definition, models.logprobs).
        advantages: float32 [B], one advantage per response, broadcast over its tokens.
        clip_low: epsilon_low in [0, 1). clip_high: epsilon_high >= 0.
        log_ratio_bound: > 0.

    Returns:
        (loss_tok float32 [B, R], clipped bool [B, R]); padded positions hold finite junk, mask them.

    Raises:
        ValueError: shape mismatch or clip range out of bounds.
    """
    _check_same_shape(logprobs, old_logprobs, "old_logprobs")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(
            f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low} clip_high={clip_high}"
        )
    log_ratio = (logprobs - old_logprobs).clamp(-log_ratio_bound, log_ratio_bound)
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = -ratio * adv
    clipped_loss = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    clipped = clipped_loss > unclipped
    return torch.where(clipped, clipped_loss, unclipped), clipped


def aggregate(
    loss_tok: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar, counting only masked-in tokens.

    Modes (field case B11, rows r0 = [2,4,6,8 | 50,50], r1 = [10 | 50,...], horizon 6):
        "token-mean":              sum of valid tokens / num_tokens                 -> 30 / 5 = 6.0
        "seq-mean-token-mean":     sum_b (row sum / row tokens) / num_seqs          -> (5 + 10) / 2 = 7.5
        "seq-mean-token-sum-norm": sum_b (row sum / horizon) / num_seqs  (Dr. GRPO) -> 15 / 6 = 2.5

    Gradient accumulation: pass the WHOLE mini-batch's ``num_tokens`` (valid tokens) and ``num_seqs``
    (rows with at least one valid token); the sum of the micro-batch results then equals the value
    on the full mini-batch (B11: r0 and r1 in separate micro-batches, token-mean 4.0 + 2.0 = 6.0).
    Defaults are this call's own counts. A row with no valid token contributes 0 and is not a sequence.

    Args:
        loss_tok: float [B, R] per-token loss (may hold inf/NaN at masked positions).
        mask: bool [B, R], True at real tokens.
        mode: one of ``AGGREGATION_MODES``.
        num_tokens: > 0, denominator of "token-mean".
        num_seqs: > 0, denominator of the two seq-mean modes.
        horizon: > 0, the constant normaliser of "seq-mean-token-sum-norm" (the response budget R in
            tokens); required for that mode.

    Returns:
        float scalar tensor (0-dim), dtype of ``loss_tok``; 0.0 if nothing is valid.

    Raises:
        ValueError: unknown mode, shape/dtype mismatch, missing horizon, or a non-positive count.
    """
    _check_mask(loss_tok, mask)
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"mode must be one of {AGGREGATION_MODES}, got {mode!r}")
    for name, value in (("num_tokens", num_tokens), ("num_seqs", num_seqs), ("horizon", horizon)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    kept = torch.where(mask, loss_tok, torch.zeros_like(loss_tok))
    if mode == "token-mean":
        return kept.sum() / _count(mask.sum(), num_tokens)
    row_tokens = mask.sum(dim=1)
    if mode == "seq-mean-token-mean":
        row_loss = kept.sum(dim=1) / row_tokens.clamp(min=1)
    else:
        if horizon is None:
            raise ValueError("mode 'seq-mean-token-sum-norm' needs horizon (the response budget in tokens)")
        row_loss = kept.sum(dim=1) / horizon
    return row_loss.sum() / _count((row_tokens > 0).sum(), num_seqs)


def _count(own: torch.Tensor, given: int | None) -> torch.Tensor | int:
    """The caller's count if given, else this call's own count (a tensor, no host sync), at least 1."""
    return given if given is not None else own.clamp(min=1)


class TokenLoss(NamedTuple):
    """Per-token GRPO loss and its parts, all [B, R]: ``loss`` float32 (policy + kl_coef · kl),
    ``clipped`` bool, ``kl`` float32 or None when the KL term is off."""

    loss: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor | None


def grpo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    log_ratio_bound: float = 20.0,
) -> TokenLoss:
    """GRPO per-token loss: clipped surrogate plus kl_coef · KL(pi_theta || pi_ref) (DeepSeekMath Eq. 3).

    Definition: loss = policy_loss(...) + kl_coef · kl_penalty(logprobs, ref_logprobs, kl_estimator).
    The KL term is skipped (``kl`` None) when ``ref_logprobs`` is None; it is computed (for logging)
    even when ``kl_coef`` is 0. Aggregate the result with :func:`aggregate`.

    Args:
        logprobs, old_logprobs: float32 [B, R], nats. advantages: float32 [B].
        clip_low, clip_high: see :func:`policy_loss`.
        ref_logprobs: float32 [B, R] under the frozen reference, or None.
        kl_coef: beta >= 0 (Video-R1 0.04). kl_estimator: "k1" or "k3".
        log_ratio_bound: > 0, bound on both log-ratios before their exponentials.

    Returns:
        TokenLoss(loss [B, R], clipped [B, R], kl [B, R] or None).

    Raises:
        ValueError: as :func:`policy_loss` / :func:`kl_penalty`; ``kl_coef`` > 0 without ``ref_logprobs``
            or negative.
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
    loss, clipped = policy_loss(
        logprobs, old_logprobs, advantages, clip_low, clip_high, log_ratio_bound=log_ratio_bound
    )
    if ref_logprobs is None:
        return TokenLoss(loss, clipped, None)
    kl = kl_penalty(logprobs, ref_logprobs, kl_estimator, log_ratio_bound)
    return TokenLoss(loss + kl_coef * kl, clipped, kl)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """Detached mean of ``values`` over the True entries of ``mask`` (for metrics).

    Args:
        values: float or bool [B, R]. mask: bool [B, R].
        num_tokens: > 0, denominator override for gradient accumulation (as in :func:`aggregate`).

    Returns:
        float32 scalar tensor (no host sync); 0.0 when nothing is valid.

    Raises:
        ValueError: shape mismatch or non-bool mask.
    """
    _check_mask(values, mask)
    if num_tokens is not None and num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    vals = values.detach().float()
    kept = torch.where(mask, vals, torch.zeros_like(vals))
    return kept.sum() / _count(mask.sum(), num_tokens)


def clip_fraction(clipped: torch.Tensor, mask: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """Fraction of valid tokens whose surrogate was clipped; bool [B, R] inputs, float32 scalar."""
    return masked_mean(clipped, mask, num_tokens)


def mean_kl(kl_tok: torch.Tensor, mask: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """Mean per-token KL estimate (nats) over valid tokens; float [B, R] input, float32 scalar."""
    return masked_mean(kl_tok, mask, num_tokens)


def entropy_mean(
    entropy_tok: torch.Tensor, mask: torch.Tensor, num_tokens: int | None = None
) -> torch.Tensor:
    """Mean per-token policy entropy (nats, models.logprobs.entropy) over valid tokens; float32 scalar."""
    return masked_mean(entropy_tok, mask, num_tokens)


def _check_same_shape(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name} shape {tuple(b.shape)} != logprobs shape {tuple(a.shape)}")


def _check_mask(values: torch.Tensor, mask: torch.Tensor) -> None:
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must both be [B, R]")

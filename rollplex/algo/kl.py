"""Per-token estimators of KL(pi_theta || pi_ref) from samples of pi_theta.

Source: J. Schulman, "Approximating KL divergence" (2020, http://joschu.net/blog/kl-approx.html).
With r = pi_ref(x) / pi_theta(x) and x ~ pi_theta:

    k1 = -log r = logp - ref_logp                      unbiased, high variance, can be negative
    k3 = (r - 1) - log r = exp(d) - d - 1, d = ref_logp - logp     unbiased, always >= 0

k3 is what GRPO (DeepSeekMath §4.1, Eq. 4) and Video-R1 (β = 0.04; docs/video-r1-format.md, "Rewards") use.

Overflow (field case B10): exp(d) overflows float32 just above d = 88.7. Clamping the *result* does
not help the backward pass (0 · inf = NaN), so the log-ratio d is clamped to ±``log_ratio_bound``
*before* the exponential; beyond the bound the value is constant and the gradient is exactly 0.
An optional ``value_bound`` additionally clamps the estimate itself (as OpenRLHF / verl do at 10).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k3")


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str,
    log_ratio_bound: float = 20.0,
    *,
    value_bound: float | None = None,
) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference.

    Definitions (Schulman 2020):
        "k1": logp - ref_logp (not clamped: no exponential, gradient is exactly 1 everywhere).
        "k3": exp(d) - d - 1 with d = clamp(ref_logp - logp, -bound, +bound).

    Example (B10, k3, value_bound 10): (logp, ref) = (-2.5, -3.0) -> 0.10653; (-1.0, -6.0) -> 4.00674;
    (-95.0, -2.0) -> d = 93 is clamped to 20, value clamped to 10.0, gradient 0; no NaN anywhere.

    Args:
        logprobs: float [...] (float32 [B, R] in the pipeline), policy log-probs of the sampled tokens, nats.
        ref_logprobs: float, same shape, reference log-probs of the same tokens (no gradient needed).
        estimator: "k1" or "k3".
        log_ratio_bound: > 0, bound on |d| before the exponential of k3 (Video-R1 uses 10).
        value_bound: > 0 or None; if given the estimate is clamped to [-value_bound, value_bound].

    Returns:
        float [...], same shape and dtype as ``logprobs``, nats; finite whenever the inputs are.

    Raises:
        ValueError: unknown ``estimator``, shape mismatch, or a non-positive bound.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs.shape)} != ref_logprobs shape {tuple(ref_logprobs.shape)}"
        )
    if not log_ratio_bound > 0:
        raise ValueError(f"log_ratio_bound must be > 0, got {log_ratio_bound}")
    if value_bound is not None and not value_bound > 0:
        raise ValueError(f"value_bound must be > 0 or None, got {value_bound}")
    if estimator == "k1":
        kl = logprobs - ref_logprobs
    else:
        d = (ref_logprobs - logprobs).clamp(-log_ratio_bound, log_ratio_bound)
        kl = torch.exp(d) - d - 1.0
    if value_bound is not None:
        kl = kl.clamp(-value_bound, value_bound)
    return kl

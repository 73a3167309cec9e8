"""Group-relative advantages of GRPO.

Source: DeepSeekMath (Shao et al. 2024) §4.1.2, outcome supervision: every response of a group gets
the advantage A_i = (r_i - mean(r)) / std(r) of its scalar reward, broadcast to all its tokens.
Video-R1 (docs/video-r1-format.md, "Rewards") uses A = (r - mean) / (std + 1e-4) with torch's unbiased std,
like TRL; Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") drops the division.

Shapes: G groups, N = group_size responses per group, B = G·N rows; row b is in group b // N.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool, eps: float = 1e-6
) -> tuple[torch.Tensor, int]:
    """Advantages of B responses relative to their group, and the number of zero-variance groups.

    Definition, per group g of N rewards r:

        A = r - mean_g(r)                           if not normalize_std  (Dr. GRPO)
        A = (r - mean_g(r)) / (std_g(r) + eps)      if normalize_std      (GRPO, Video-R1, TRL)

    where std_g is the unbiased (Bessel-corrected, divide by N - 1) standard deviation, i.e.
    ``torch.std`` as in Video-R1 and TRL. A group whose rewards are all exactly equal gets advantages of
    exactly 0.0 (not a rounding residue of r - mean) and is counted; with N = 1 every group counts.

    The mean, centred rewards and std are computed in float64 and the advantages rounded once to the
    rewards' dtype: in float32 the rounded mean of a nearly flat group (seven rewards of 0.35 and one a
    float32 ulp above) lies below the seven, and all eight advantages came out positive.

    Example: rewards [1, 0, 0, 1, 1, 1], group_size 3
        normalize_std=False -> ([2/3, -1/3, -1/3, 0, 0, 0], 1)
        normalize_std=True  -> ([1.1547, -0.5774, -0.5774, 0, 0, 0], 1)   (std of [1, 0, 0] = sqrt(1/3))

    Args:
        rewards: float [B] (float32 in the pipeline), total reward per response, row-major by group.
        group_size: N >= 1.
        normalize_std: divide by (std + eps).
        eps: > 0, added to the std (Video-R1 uses 1e-4).

    Returns:
        (advantages float [B], same dtype as ``rewards``; number of groups whose rewards were all equal).

    Raises:
        ValueError: ``rewards`` not 1-D floating, ``group_size`` < 1, B not a multiple of ``group_size``,
            or ``eps`` not > 0.
    """
    _check(rewards, group_size, eps)
    r_GN = rewards.view(-1, group_size).double()
    flat_G = (r_GN == r_GN[:, :1]).all(dim=1)
    centred_GN = r_GN - r_GN.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred_GN = centred_GN / (r_GN.std(dim=1, keepdim=True) + eps)
    adv_GN = torch.where(flat_G[:, None], torch.zeros_like(centred_GN), centred_GN)
    return adv_GN.reshape(-1).to(rewards.dtype), int(flat_G.sum())


def _check(rewards: torch.Tensor, group_size: int, eps: float) -> None:
    if rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(
            f"rewards must be a 1-D float tensor, got dtype={rewards.dtype} shape={tuple(rewards.shape)}"
        )
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(f"rewards has {rewards.shape[0]} rows, not a multiple of group_size={group_size}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")

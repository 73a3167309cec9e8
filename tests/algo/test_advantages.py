"""Group advantages against hand-computed values and an independent per-group loop."""

import math
import statistics
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
import torch

from rollplex.algo.advantages import group_advantages


def _loop_reference(rewards: list[float], n: int, normalize_std: bool, eps: float) -> list[float]:
    out = []
    for start in range(0, len(rewards), n):
        group = rewards[start : start + n]
        mean = statistics.fmean(group)
        if len(set(group)) == 1:
            out += [0.0] * n
            continue
        scale = statistics.stdev(group) + eps if normalize_std else 1.0
        out += [(r - mean) / scale for r in group]
    return out


def test_hand_computed_without_std():
    adv, flat = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), 3, normalize_std=False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0], abs=1e-7)
    assert flat == 1


def test_hand_computed_with_unbiased_std():
    # Group [1, 0, 0]: mean 1/3, unbiased variance (4/9 + 1/9 + 1/9) / 2 = 1/3.
    adv, flat = group_advantages(
        torch.tensor([1.0, 0.0, 0.0, 2.0, 0.0, 1.0]), 3, normalize_std=True, eps=1e-6
    )
    std = math.sqrt(1 / 3) + 1e-6
    assert adv[:3].tolist() == pytest.approx([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std], abs=1e-6)
    # Group [2, 0, 1]: mean 1, unbiased std 1.
    assert adv[3:].tolist() == pytest.approx([1 / (1 + 1e-6), -1 / (1 + 1e-6), 0.0], abs=1e-6)
    assert flat == 0


def test_video_r1_eps_matches_its_formula():
    rewards = torch.tensor([2.0, 1.0, 1.0, 0.0])
    adv, _ = group_advantages(rewards, 4, normalize_std=True, eps=1e-4)
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    assert torch.allclose(adv, expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_matches_loop_reference_on_random_groups(normalize_std):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (40,), generator=gen).float() * 0.5
    rewards[8:16] = 0.7  # one flat group whose mean is not exact in float32
    adv, flat = group_advantages(rewards, 8, normalize_std=normalize_std, eps=1e-6)
    expected = _loop_reference(rewards.tolist(), 8, normalize_std, 1e-6)
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)
    assert flat == sum(len(set(rewards[i : i + 8].tolist())) == 1 for i in range(0, 40, 8))


def test_flat_groups_are_exactly_zero():
    # The float32 mean of three 0.9s (or 1.7s) is not exactly 0.9; the advantage must still be exactly 0.
    rewards = torch.tensor([0.9, 0.9, 0.9, 1.7, 1.7, 1.7], dtype=torch.float32)
    assert not torch.equal(rewards[:3] - rewards[:3].mean(), torch.zeros(3))
    for normalize_std in (False, True):
        adv, flat = group_advantages(rewards, 3, normalize_std=normalize_std)
        assert torch.equal(adv, torch.zeros(6))
        assert flat == 2


def test_group_size_one_is_all_flat():
    adv, flat = group_advantages(torch.tensor([0.3, 2.0]), 1, normalize_std=True)
    assert torch.equal(adv, torch.zeros(2)) and flat == 2


def test_groups_are_contiguous_rows():
    # Row b belongs to group b // N: swapping the layout changes which rows are compared.
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, normalize_std=False)
    assert adv.tolist() == [0.5, -0.5, 0.5, -0.5]


@pytest.mark.parametrize(
    ("rewards", "group_size", "eps", "field"),
    [
        (torch.zeros(5), 2, 1e-6, "multiple of group_size"),
        (torch.zeros(4), 0, 1e-6, "group_size"),
        (torch.zeros(2, 2), 2, 1e-6, "1-D"),
        (torch.zeros(4, dtype=torch.int64), 2, 1e-6, "float"),
        (torch.zeros(4), 2, 0.0, "eps"),
    ],
)
def test_bad_inputs_raise(rewards, group_size, eps, field):
    with pytest.raises(ValueError, match=field):
        group_advantages(rewards, group_size, normalize_std=True, eps=eps)


def _exact_group(rewards: list[float], eps: float) -> tuple[Fraction, list[Fraction], Decimal, list[Decimal]]:
    """Exact mean and centred rewards (Fraction), std with ddof 1 and advantages to 40 digits (Decimal)."""
    r = [Fraction(x) for x in rewards]
    mean = sum(r) / len(r)
    centred = [x - mean for x in r]
    variance = sum(c * c for c in centred) / (len(r) - 1)
    with localcontext() as ctx:
        ctx.prec = 40
        std = (Decimal(variance.numerator) / Decimal(variance.denominator)).sqrt()
        scale = std + Decimal(eps)
        adv = [Decimal(c.numerator) / Decimal(c.denominator) / scale for c in centred]
    return mean, centred, std, adv


def test_nearly_flat_group_against_exact_arithmetic():
    """Seven rewards of 0.35 and one a float32 ulp above: the float32 mean rounds below the seven, and
    float32 statistics gave all eight a positive advantage (+0.0287 and +0.0575)."""
    seven = np.float32(0.35)
    rewards = torch.tensor([seven] * 7 + [np.nextafter(seven, np.float32(1))], dtype=torch.float32)
    assert float(rewards.mean()) < float(seven)  # the float32 rounding the fix avoids
    values = [float(x) for x in rewards.tolist()]
    mean, centred, std, exact = _exact_group(values, eps=1e-6)
    r64 = torch.tensor(values, dtype=torch.float64)
    assert float(r64.mean()) == mean  # float64 holds the mean of eight float32 values exactly
    assert [Fraction(float(c)) for c in r64 - r64.mean()] == centred
    assert float(r64.std()) == pytest.approx(float(std), rel=1e-15)
    adv, flat = group_advantages(rewards, 8, normalize_std=True, eps=1e-6)
    assert flat == 0
    assert [float(a) for a in exact] == pytest.approx([-0.0037] * 7 + [0.0258], abs=1e-4)
    assert adv.tolist() == pytest.approx([float(a) for a in exact], rel=1e-6)
    assert all((a < 0) == (c < 0) for a, c in zip(adv.tolist(), centred))
    adv, _ = group_advantages(rewards, 8, normalize_std=False)
    assert adv.tolist() == pytest.approx([float(c) for c in centred], rel=1e-6)
    assert (adv[:7] < 0).all() and adv[7] > 0

"""Policy loss, aggregation (field case B11) and masked statistics against hand values and loops."""

import math

import pytest
import torch

from rollplex.algo.kl import kl_penalty
from rollplex.algo.losses import (
    aggregate,
    clip_fraction,
    entropy_mean,
    grpo_token_loss,
    masked_mean,
    mean_kl,
    policy_loss,
)

B11_LOSS = [[2.0, 4.0, 6.0, 8.0, 50.0, 50.0], [10.0, 50.0, 50.0, 50.0, 50.0, 50.0]]
B11_MASK = [[True, True, True, True, False, False], [True, False, False, False, False, False]]


def _b11(requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(B11_LOSS, requires_grad=requires_grad), torch.tensor(B11_MASK)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("token-mean", 6.0), ("seq-mean-token-mean", 7.5), ("seq-mean-token-sum-norm", 2.5)],
)
def test_b11_modes(mode, expected):
    loss, mask = _b11()
    assert aggregate(loss, mask, mode, horizon=6).item() == pytest.approx(expected, abs=1e-6)


def test_b11_token_mean_gradient_and_no_unmasked_numerator():
    loss, mask = _b11(requires_grad=True)
    value = aggregate(loss, mask, "token-mean")
    assert value.item() != pytest.approx(76.0)  # 380 / 5, the unmasked-numerator fault
    value.backward()
    assert torch.equal(loss.grad, torch.where(mask, 0.2, 0.0))


def test_seq_mean_token_mean_gradient():
    loss, mask = _b11(requires_grad=True)
    aggregate(loss, mask, "seq-mean-token-mean").backward()
    expected = torch.tensor([[0.125] * 4 + [0.0] * 2, [0.5] + [0.0] * 5])
    assert torch.equal(loss.grad, expected)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("token-mean", 6.0), ("seq-mean-token-mean", 7.5), ("seq-mean-token-sum-norm", 2.5)],
)
def test_b11_micro_batch_split_sums_to_full_batch(mode, expected):
    loss, mask = _b11()
    parts = [
        aggregate(loss[i : i + 1], mask[i : i + 1], mode, num_tokens=5, num_seqs=2, horizon=6) for i in (0, 1)
    ]
    assert sum(p.item() for p in parts) == pytest.approx(expected, abs=1e-6)


def test_b11_averaging_micro_token_means_is_the_wrong_answer():
    loss, mask = _b11()
    own = [aggregate(loss[i : i + 1], mask[i : i + 1], "token-mean").item() for i in (0, 1)]
    assert own == [5.0, 10.0]  # their average 7.5 is what passing num_tokens prevents


def test_inf_and_nan_at_masked_positions_do_not_leak():
    loss = torch.tensor([[1.0, float("inf")], [float("nan"), 3.0]], requires_grad=True)
    mask = torch.tensor([[True, False], [False, True]])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss.grad = None
        value = aggregate(loss, mask, mode, horizon=2)
        value.backward()
        assert torch.isfinite(value)
        assert loss.grad[0, 1].item() == 0.0 and loss.grad[1, 0].item() == 0.0


def test_fully_masked_row_is_not_a_sequence_and_empty_mask_gives_zero():
    loss = torch.tensor([[4.0, 2.0], [7.0, 7.0]])
    mask = torch.tensor([[True, True], [False, False]])
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == 3.0
    assert aggregate(loss, torch.zeros(2, 2, dtype=torch.bool), "token-mean").item() == 0.0


def _loop_aggregate(loss: list[list[float]], mask: list[list[bool]], mode: str, horizon: int) -> float:
    rows = [[x for x, m in zip(r, mr, strict=True) if m] for r, mr in zip(loss, mask, strict=True)]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) / horizon for r in rows) / len(rows)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_matches_loop_on_random_input(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    lens = torch.tensor([1, 9, 4, 7, 2, 5])
    mask = torch.arange(9)[None, :] < lens[:, None]
    expected = _loop_aggregate(loss.tolist(), mask.tolist(), mode, horizon=9)
    assert aggregate(loss, mask, mode, horizon=9).item() == pytest.approx(expected, rel=1e-12)


def test_policy_loss_is_minus_advantage_at_ratio_one():
    logp = torch.tensor([[-0.7, -2.0, -0.1], [-1.5, -0.2, -3.0]], requires_grad=True)
    adv = torch.tensor([0.8, -1.2])
    loss, clipped = policy_loss(logp, logp.detach(), adv, 0.2, 0.28)
    assert torch.equal(loss.detach(), (-adv[:, None]).expand(2, 3))
    assert not clipped.any()
    loss.sum().backward()
    assert torch.equal(logp.grad, (-adv[:, None]).expand(2, 3))  # d(-r A)/d logp = -r A with r = 1


def test_policy_loss_hand_values_and_clip_gradients():
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    logp = ratios.log()[:, None].clone().requires_grad_(True)
    loss, clipped = policy_loss(logp, torch.zeros(4, 1), adv, 0.2, 0.28)
    assert loss[:, 0].tolist() == pytest.approx([-1.28, 1.5, -0.5, 0.8], abs=1e-6)
    assert clipped[:, 0].tolist() == [True, False, False, True]
    loss.sum().backward()
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, 1.5, -0.5, 0.0], abs=1e-6)


def _loop_policy_loss(lp: float, old: float, a: float, low: float, high: float) -> float:
    r = math.exp(lp - old)
    return -min(r * a, min(max(r, 1 - low), 1 + high) * a)


def test_policy_loss_matches_loop_on_random_input():
    gen = torch.Generator().manual_seed(1)
    logp = torch.randn(5, 7, generator=gen, dtype=torch.float64) * 0.3 - 1.0
    old = logp + torch.randn(5, 7, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(5, generator=gen, dtype=torch.float64)
    loss, clipped = policy_loss(logp, old, adv, 0.1, 0.3)
    for b in range(5):
        for t in range(7):
            ref = _loop_policy_loss(logp[b, t].item(), old[b, t].item(), adv[b].item(), 0.1, 0.3)
            assert loss[b, t].item() == pytest.approx(ref, rel=1e-12)
    assert clipped.any() and not clipped.all()


def test_padding_with_extreme_log_ratio_gives_finite_zero_gradient():
    logp = torch.tensor([[-0.5, 0.0]], requires_grad=True)
    old = torch.tensor([[-0.5, -1000.0]])  # position 1 is padding with junk
    loss, _ = policy_loss(logp, old, torch.tensor([-1.0]), 0.2, 0.2)
    value = aggregate(loss, torch.tensor([[True, False]]), "token-mean")
    value.backward()
    assert torch.isfinite(loss).all() and value.item() == pytest.approx(1.0)
    assert logp.grad.tolist() == [[1.0, 0.0]]


def test_grpo_token_loss_adds_weighted_kl():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    adv = torch.tensor([0.5])
    out = grpo_token_loss(logp, logp, adv, clip_low=0.2, clip_high=0.2, ref_logprobs=ref, kl_coef=0.04)
    kl = kl_penalty(logp, ref, "k3")
    assert torch.equal(out.kl, kl)
    assert torch.allclose(out.loss, -0.5 + 0.04 * kl, atol=0, rtol=1e-7)
    no_kl = grpo_token_loss(logp, logp, adv, clip_low=0.2, clip_high=0.2)
    assert no_kl.kl is None and torch.equal(no_kl.loss, torch.full((1, 2), -0.5))
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_token_loss(logp, logp, adv, clip_low=0.2, clip_high=0.2, kl_coef=0.04)


def test_masked_statistics():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    clipped = torch.tensor([[True, False, True], [True, True, True]])
    assert clip_fraction(clipped, mask).item() == pytest.approx(2 / 3)
    kl = torch.tensor([[0.1, 0.2, float("nan")], [0.6, float("inf"), 9.0]], requires_grad=True)
    value = mean_kl(kl, mask)
    assert value.item() == pytest.approx(0.3) and not value.requires_grad
    ent = torch.tensor([[1.0, 2.0, 5.0], [3.0, 5.0, 5.0]])
    assert entropy_mean(ent, mask).item() == pytest.approx(2.0)
    assert masked_mean(ent, mask, num_tokens=6).item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: aggregate(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "sum"), "mode"),
        (lambda: aggregate(torch.zeros(1, 2), torch.ones(1, 2), "token-mean"), "mask"),
        (lambda: aggregate(torch.zeros(1, 2), torch.ones(1, 3, dtype=torch.bool), "token-mean"), "mask"),
        (
            lambda: aggregate(
                torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "seq-mean-token-sum-norm"
            ),
            "horizon",
        ),
        (
            lambda: aggregate(
                torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "token-mean", num_tokens=0
            ),
            "num_tokens",
        ),
        (lambda: policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), 1.0, 0.2), "clip_low"),
        (lambda: policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), 0.2, -0.1), "clip_high"),
        (lambda: policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(2), 0.2, 0.2), "advantages"),
        (lambda: policy_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1), 0.2, 0.2), "old_logprobs"),
    ],
)
def test_bad_arguments_raise(call, field):
    with pytest.raises(ValueError, match=field):
        call()

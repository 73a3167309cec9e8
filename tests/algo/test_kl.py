"""KL estimators: field case B10 numbers and gradients, and unbiasedness against the exact KL."""

import math

import pytest
import torch

from rollplex.algo.kl import kl_penalty

B10_LOGP = [-2.5, -1.0, -95.0]
B10_REF = [-3.0, -6.0, -2.0]
KL_COEF = 0.01


def _b10_grad(n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.tensor(B10_LOGP[:n_tokens], requires_grad=True)
    kl = kl_penalty(logp, torch.tensor(B10_REF[:n_tokens]), "k3", 20.0, value_bound=10.0)
    (KL_COEF * kl).sum().backward()
    return kl.detach(), logp.grad


def test_b10_values():
    kl, _ = _b10_grad(3)
    assert kl.tolist() == pytest.approx([0.10653, 4.00674, 10.0], abs=1e-5)
    assert kl[0].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-7)


def test_b10_gradients_finite_and_independent_of_the_saturated_token():
    _, grad3 = _b10_grad(3)
    _, grad2 = _b10_grad(2)
    assert torch.isfinite(grad3).all()
    # d k3 / d logp = 1 - exp(d) with d = ref - logp.
    expected = [KL_COEF * (1 - math.exp(-0.5)), KL_COEF * (1 - math.exp(-5.0))]
    assert grad3[:2].tolist() == pytest.approx(expected, rel=1e-6)
    assert torch.equal(grad3[:2], grad2)
    assert grad3[2].item() == 0.0


def test_b10_clamping_only_the_output_gives_nan_gradient():
    # The fault of the case, reproduced to show that the test above can fail.
    logp = torch.tensor(B10_LOGP, requires_grad=True)
    d = torch.tensor(B10_REF) - logp
    (KL_COEF * (torch.exp(d) - d - 1).clamp(max=10.0)).sum().backward()
    assert torch.isnan(logp.grad[2])


def test_log_ratio_bound_without_value_bound():
    logp = torch.tensor([-95.0, 0.0], requires_grad=True)
    ref = torch.tensor([-2.0, -50.0])
    kl = kl_penalty(logp, ref, "k3", 10.0)  # Video-R1's bound
    assert kl[0].item() == pytest.approx(math.exp(10.0) - 11.0, rel=1e-6)
    assert kl[1].item() == pytest.approx(math.exp(-10.0) + 9.0, rel=1e-6)
    kl.sum().backward()
    assert logp.grad.tolist() == [0.0, 0.0]


def test_k1_is_log_ratio_with_unit_gradient():
    logp = torch.tensor([-1.0, -3.0, -95.0], requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([-2.0, -1.0, -2.0]), "k1")
    assert kl.tolist() == [1.0, -2.0, -93.0]
    kl.sum().backward()
    assert logp.grad.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_estimators_are_unbiased_for_kl(estimator):
    # E_{x ~ p}[k(x)] = KL(p || q) exactly, computed with the exact weights p(x).
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), 0)
    logq = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), 0)
    exact = float((logp.exp() * (logp - logq)).sum())
    estimate = float((logp.exp() * kl_penalty(logp, logq, estimator)).sum())
    assert estimate == pytest.approx(exact, rel=1e-9)


def test_k3_is_zero_and_flat_at_equal_logprobs():
    logp = torch.tensor([[-0.3, -4.0]], requires_grad=True)
    kl = kl_penalty(logp, logp.detach().clone(), "k3")
    kl.sum().backward()
    assert torch.equal(kl.detach(), torch.zeros(1, 2)) and torch.equal(logp.grad, torch.zeros(1, 2))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"estimator": "k2"}, "estimator"),
        ({"estimator": "k3", "log_ratio_bound": 0.0}, "log_ratio_bound"),
        ({"estimator": "k3", "value_bound": -1.0}, "value_bound"),
    ],
)
def test_bad_arguments_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        kl_penalty(torch.zeros(2), torch.zeros(2), **kwargs)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(3), "k3")

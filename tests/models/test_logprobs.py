"""The one token log-prob definition: field cases B05 (banned vision ids) and B08 (log_softmax of the
masked logits over T, full vocabulary), and the entropy of that distribution."""

import math

import pytest
import torch

from rollplex.models.logprobs import entropy, masked_logits, token_logprobs

B08_LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
NO_BAN = torch.zeros(0, dtype=torch.int64)


def test_b08_trainer_logprob_definition():
    lp = token_logprobs(B08_LOGITS, 0.6, NO_BAN)
    assert lp.dtype == torch.float32
    assert lp[0, 0].item() == pytest.approx(-0.2081, abs=1e-4)
    assert lp[0, 1].item() == pytest.approx(-1.8747, abs=1e-4)
    # Independent closed form: log_softmax(x / T)_i = x_i / T - log sum_j exp(x_j / T).
    x = [2.0, 1.0, 0.0, -1.0]
    log_z = math.log(sum(math.exp(v / 0.6) for v in x))
    assert lp[0].tolist() == pytest.approx([v / 0.6 - log_z for v in x], abs=1e-6)
    # The two wrong definitions of the case are far from it.
    assert lp[0, 0].item() != pytest.approx(-0.4402, abs=1e-3)
    assert lp[0, 0].item() != pytest.approx(-0.7336, abs=1e-3)


def test_masked_logits_sets_minus_inf_and_blocks_gradient():
    logits = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    out = masked_logits(logits, torch.tensor([2], dtype=torch.int64))
    assert out[0].tolist() == [1.0, 2.0, float("-inf")]
    assert logits[0, 2].item() == 3.0  # input untouched
    torch.log_softmax(out, -1)[0, 0].backward()
    assert logits.grad[0, 2].item() == 0.0
    with pytest.raises(ValueError, match="banned_ids"):
        masked_logits(logits, torch.tensor([2], dtype=torch.int32))


def test_bfloat16_logits_give_float32_logprobs():
    logits = B08_LOGITS.to(torch.bfloat16)
    lp = token_logprobs(logits, 0.6, NO_BAN)
    assert lp.dtype == torch.float32
    assert lp[0, 0].item() == pytest.approx(-0.2081, abs=1e-4)  # these logits are exact in bf16


def test_entropy_against_closed_form_and_banned_entries():
    p = torch.tensor([0.5, 0.25, 0.25])
    assert entropy(p.log()).item() == pytest.approx(1.5 * math.log(2), abs=1e-6)
    lp = token_logprobs(torch.tensor([[0.0, 0.0, 5.0]], requires_grad=True), 1.0, torch.tensor([2]))
    ent = entropy(lp)
    assert ent.item() == pytest.approx(math.log(2), abs=1e-6)
    logits = torch.tensor([[0.3, -0.2, 5.0]], requires_grad=True)
    entropy(token_logprobs(logits, 1.0, torch.tensor([2]))).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2].item() == 0.0


def test_logprobs_need_positive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(B08_LOGITS, 0.0, NO_BAN)

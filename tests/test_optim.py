"""The optimizer drops a gradient that is not finite: no step, weights and AdamW state unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from rollplex.memory.chunked_adamw import ChunkedAdamW


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3).to(dtype)


def _backward(model, poison: float | None = None):
    model(torch.ones(2, 4, dtype=model.weight.dtype)).sum().backward()
    if poison is not None:
        model.weight.grad[0, 0] = poison


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: through the FP32 masters
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_gradient_that_is_not_finite_is_dropped(dtype, poison):
    model = _model(dtype)
    opt = ChunkedAdamW(
        list(model.parameters()), lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, chunk_elements=5
    )
    _backward(model)
    assert opt.clip_and_step(1.0) > 0  # a finite step first, so there is AdamW state to keep
    before, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _backward(model, poison)
    norm = opt.clip_and_step(1.0)
    assert not torch.isfinite(torch.tensor(norm))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no NaN written anywhere
    assert all(p.grad is None for p in model.parameters())
    inner_before, inner_after = state["inner"]["state"], opt.state_dict()["inner"]["state"]
    assert inner_before.keys() == inner_after.keys()
    for i, entry in inner_before.items():  # step count, exp_avg and exp_avg_sq of every parameter
        assert entry.keys() == inner_after[i].keys()
        assert all(torch.equal(entry[k], inner_after[i][k]) for k in entry)
    assert all(
        torch.equal(m, n) for m, n in zip(state.get("masters", []), opt.state_dict().get("masters", []))
    )
    _backward(model)
    opt.clip_and_step(1.0)  # and the next finite gradient steps as usual
    assert not torch.equal(before["weight"], model.state_dict()["weight"])
    assert all(torch.isfinite(p).all() for p in model.parameters())

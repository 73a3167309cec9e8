"""The vision MLP on zero-padded weights (``models.vision_mlp``) equals transformers' MLP: one MLP and
the whole vision tower, values and gradients, in float64 (with the padding forced, as float64 widths
need none at 16 bytes), and in bf16 at the 3B shape on CUDA."""

from __future__ import annotations

import copy
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

from rollplex.models import vision_mlp
from rollplex.models.forward import prepare_model
from rollplex.models.vision_mlp import (
    PaddedLinear,
    PaddedVisionMLP,
    padded_mlp,
    padded_width,
    set_vision_mlp_padding,
)
from tests.numerics.conftest import tiny_config


def _mlp(hidden: int, inter: int, bias: bool, dtype=torch.float64, device="cpu") -> Qwen2_5_VLMLP:
    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")
    mlp = Qwen2_5_VLMLP(config, bias=bias).to(device=device, dtype=dtype)
    if bias:  # nonzero biases, as trained weights have (the padded units' zeros come from the pads)
        with torch.no_grad():
            for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                linear.bias.normal_()
    return mlp


def _value_and_grads(forward, mlp, x):
    x = x.clone().requires_grad_(True)
    out = forward(x)
    params = [p for p in mlp.parameters()]
    return out, torch.autograd.grad(out.square().sum(), [x, *params])


@pytest.mark.parametrize(("inter", "align", "bias"), [(20, 64, True), (20, 64, False), (13, 16, True)])
def test_padded_mlp_equals_transformers(inter, align, bias, monkeypatch):
    """20 → 24 (align 64 bytes of float64) and 13 → 14 (16 bytes): output and every gradient (input,
    weights, biases) as transformers' forward, to float64 rounding."""
    mlp = _mlp(12, inter, bias)
    wide = padded_width(inter, torch.float64, align)
    assert wide > inter
    x = torch.randn(7, 12, dtype=torch.float64)
    want, want_grads = _value_and_grads(mlp, mlp, x)
    linear, shapes = vision_mlp.F.linear, []

    def spy(inp, weight, bias=None):
        shapes.append(tuple(weight.shape))
        return linear(inp, weight, bias)

    monkeypatch.setattr(vision_mlp.F, "linear", spy)
    got, got_grads = _value_and_grads(lambda t: padded_mlp(mlp, t, align), mlp, x)
    assert shapes == [(wide, 12), (wide, 12), (12, wide)]  # the padded products ran
    assert (got - want).abs().max() <= 1e-12
    for a, b in zip(got_grads, want_grads, strict=True):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-12 * max(1.0, float(b.abs().max()))


def test_backward_keeps_no_padded_weight_copy(monkeypatch):
    """Between forward and backward no padded weight copy ([I', C] or [C, I']) is alive, whether saved
    for backward or held otherwise; autograd keeps the weights themselves. So the padded MLP holds no
    more memory than transformers' (but for the padded columns of its [T, I'] activations)."""
    mlp = _mlp(12, 20, True)
    saved, copies, pad = [], [], vision_mlp.F.pad

    def pack(t):
        saved.append(t)
        return t

    def spy_pad(t, *args, **kwargs):
        out = pad(t, *args, **kwargs)
        if tuple(out.shape) in ((24, 12), (12, 24)):
            copies.append(weakref.ref(out))
        return out

    monkeypatch.setattr(vision_mlp.F, "pad", spy_pad)
    x = torch.randn(7, 12, dtype=torch.float64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = padded_mlp(mlp, x, 64)
    gc.collect()
    assert len(copies) == 3 and all(ref() is None for ref in copies)
    weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    assert all(any(t is w for t in saved) for w in weights)
    out.sum().backward()  # and backward still runs from them


def test_padded_units_are_zero():
    """gate and up give exactly 0 in the padded columns (act(0) · 0 = 0 there, whatever the act)."""
    mlp = _mlp(12, 20, True)
    x = torch.randn(7, 12, dtype=torch.float64)
    for linear in (mlp.gate_proj, mlp.up_proj):
        out = PaddedLinear.apply(x, linear.weight, linear.bias, 4, 0)
        assert out.shape == (7, 24) and torch.equal(out[:, 20:], torch.zeros(7, 4, dtype=torch.float64))
        assert (out[:, :20] - linear(x)).abs().max() <= 1e-12


@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize(("out_pad", "in_pad"), [(3, 0), (0, 2)])
def test_padded_linear_gradients_by_finite_differences(needs, out_pad, in_pad):
    """PaddedLinear's backward against torch.autograd.gradcheck's finite differences (float64), for the
    gate/up form (padded outputs) and the down form (padded inputs), with some inputs frozen."""
    x = torch.randn(3, 5, 4 + in_pad, dtype=torch.float64, requires_grad=needs[0])
    with torch.no_grad():
        x[..., 4:] = 0.0  # padded input columns are zero, as the MLP's activations are
    weight = torch.randn(6, 4, dtype=torch.float64, requires_grad=needs[1])
    bias = torch.randn(6, dtype=torch.float64, requires_grad=needs[2])
    assert torch.autograd.gradcheck(lambda *a: PaddedLinear.apply(*a, out_pad, in_pad), (x, weight, bias))


def test_padded_width():
    assert padded_width(3420, torch.bfloat16) == 3424  # the Qwen2.5-VL 3B/7B vision MLP in bf16
    assert padded_width(3420, torch.float32) == 3420
    assert padded_width(3456, torch.bfloat16) == 3456  # 32B: already aligned
    assert padded_width(1, torch.float64) == 2
    with pytest.raises(ValueError, match="align_bytes"):
        padded_width(10, torch.float32, 6)


def test_vision_tower_padded_equals_transformers(monkeypatch):
    """The whole tower (both blocks padded, 48 → 60 at a forced 160-byte alignment): pooled output and
    the gradients of pixels and of every MLP weight as transformers' tower, to float64 rounding."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    monkeypatch.setattr(vision_mlp, "ALIGN_BYTES", 160)
    torch.manual_seed(0)
    reference = Qwen2_5_VLForConditionalGeneration(tiny_config()).double()
    padded = copy.deepcopy(reference)
    assert set_vision_mlp_padding(padded, True) == 2
    grid_thw = torch.tensor([(2, 12, 20)])
    pixels = torch.randn(int(grid_thw.prod()), 3 * 2 * 14 * 14, dtype=torch.float64)
    linear, padded_calls = vision_mlp.F.linear, []

    def spy(inp, weight, bias=None):
        padded_calls.append(60 in weight.shape)
        return linear(inp, weight, bias)

    monkeypatch.setattr(vision_mlp.F, "linear", spy)
    results = []
    for model in (reference, padded):
        px = pixels.clone().requires_grad_(True)
        out = model.model.visual(px, grid_thw=grid_thw).pooler_output
        mlps = [b.mlp for b in model.model.visual.blocks]
        weights = [w for m in mlps for w in (m.gate_proj.weight, m.up_proj.bias, m.down_proj.weight)]
        results.append((out, torch.autograd.grad(out.square().sum(), [px, *weights])))
    (want, want_grads), (got, got_grads) = results
    assert sum(padded_calls) == 6  # three padded products per block, in the padded tower only
    assert (got - want).abs().max() <= 1e-12
    for a, b in zip(got_grads, want_grads, strict=True):
        assert (a - b).abs().max() <= 1e-12 * max(1.0, float(b.abs().max()))


def test_switching_keeps_parameters_and_survives_copies():
    """prepare_model pads by default; the switch changes only the MLP's class: same state dict keys and
    tensors, a deep copy keeps it, and switching back restores transformers' class."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(tiny_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    keys = list(before)
    prepare_model(model)
    assert all(type(b.mlp) is PaddedVisionMLP for b in model.model.visual.blocks)
    after = model.state_dict()
    assert list(after) == keys and all(torch.equal(before[k], after[k]) for k in keys)
    assert type(copy.deepcopy(model).model.visual.blocks[0].mlp) is PaddedVisionMLP
    assert set_vision_mlp_padding(model, True) == 0  # already padded
    prepare_model(model, vision_mlp_padding=False)
    assert all(type(b.mlp) is Qwen2_5_VLMLP for b in model.model.visual.blocks)
    assert list(model.state_dict()) == keys


def test_wrapped_projections_are_left_alone(caplog):
    """A projection with a forward hook (as adapters and offloading add) would be bypassed by the padded
    forward: that block keeps transformers' MLP, with a warning; the other block is padded."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(tiny_config())
    hooked = model.model.visual.blocks[0].mlp
    hooked.up_proj.register_forward_hook(lambda module, args, out: out)
    with caplog.at_level("WARNING"):
        assert set_vision_mlp_padding(model, True) == 1
    assert type(hooked) is Qwen2_5_VLMLP and type(model.model.visual.blocks[1].mlp) is PaddedVisionMLP
    assert "left 1 of 2 vision blocks unpadded" in caplog.text
    later = model.model.visual.blocks[1].mlp  # a hook added after padding: switching again unpads it
    later.down_proj.register_forward_pre_hook(lambda module, args: None)
    assert set_vision_mlp_padding(model, True) == 1 and type(later) is Qwen2_5_VLMLP
    assert "left 2 of 2 vision blocks unpadded" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_at_the_3b_shape_on_gpu():
    """bf16, C = 1280, I = 3420 → 3424, 2,048 patches: output and gradients of the padded MLP are as
    close to the float64 MLP as transformers' own bf16 MLP is (within 1.5× its error, plus bf16
    resolution)."""
    mlp = _mlp(1280, 3420, True, torch.bfloat16, "cuda")
    exact = copy.deepcopy(mlp).double()
    x = torch.randn(2048, 1280, device="cuda", dtype=torch.bfloat16)
    want, want_grads = _value_and_grads(exact, exact, x.double())
    plain, plain_grads = _value_and_grads(mlp, mlp, x)
    got, got_grads = _value_and_grads(lambda t: padded_mlp(mlp, t), mlp, x)
    for ours, theirs, truth in zip(
        (got, *got_grads), (plain, *plain_grads), (want, *want_grads), strict=True
    ):
        scale = float(truth.abs().max())
        err_ours = float((ours.double() - truth).abs().max())
        err_theirs = float((theirs.double() - truth).abs().max())
        assert err_ours <= 1.5 * err_theirs + 2**-8 * scale

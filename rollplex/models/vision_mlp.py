"""The vision tower's MLP with its intermediate width padded to a 16-byte-aligned size for cuBLAS.

Legend: T vision patches, C vision hidden size, I the MLP's intermediate size, I' = I rounded up to a
multiple of ``ALIGN_BYTES`` / element size.

Each vision block of Qwen2.5-VL computes down(SiLU(gate(x)) · up(x)) with I = 3420 for the 3B and 7B
models (3456 for 32B: already aligned). In bf16 a row of 3420 elements is 6,840 bytes, not a multiple
of 16, so the [T, I] activations and the [C, I] down weight have leading dimensions cuBLAS's sm90
kernels cannot take, and the MLP's products fall back to sm80 kernels (in a kernel profile of a GRPO
step, most of the time spent in those is the vision MLP's: benchmarks/README.md).

``PaddedVisionMLP.forward`` runs the same MLP on weights padded with zeros to I' outputs (gate, up and
their biases) and I' inputs (down). The padded units are exactly zero — gate and up give 0 there,
act(0) · 0 = 0, and down's padded columns are 0 — so the output equals the unpadded MLP's up to the
rounding of the products (a different kernel sums in a different order), and the gradients of the
original weights are the padded gradients' unpadded part. The padded weight copies are built per call
and not kept for backward (``PaddedLinear`` keeps the weights themselves and pads again there), so a
pass holds no more memory than the unpadded MLP, but for the 4 padded columns of the [T, I']
activations.

``set_vision_mlp_padding`` switches a model's vision blocks between the two forwards by swapping their
MLP's class, so parameter names, state dicts and checkpoints are unchanged. The padded forward reads
the projections' weights directly, so it only takes blocks whose three projections are plain
``nn.Linear`` modules without hooks; others (adapters, quantised or hooked layers) keep transformers'
forward, with a warning.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

log = logging.getLogger(__name__)

ALIGN_BYTES = 16  # leading dimensions cuBLAS's sm90 (TMA) kernels accept are multiples of 16 bytes


def padded_width(width: int, dtype: torch.dtype, align_bytes: int = ALIGN_BYTES) -> int:
    """``width`` (elements) rounded up to a multiple of ``align_bytes`` bytes of ``dtype``.

    Raises:
        ValueError: ``align_bytes`` not a positive multiple of the dtype's element size.
    """
    size = dtype.itemsize
    if align_bytes <= 0 or align_bytes % size:
        raise ValueError(f"align_bytes must be a positive multiple of {size} ({dtype}), got {align_bytes}")
    step = align_bytes // size
    return -(-width // step) * step


def padded_mlp(mlp: Qwen2_5_VLMLP, x: torch.Tensor, align_bytes: int = ALIGN_BYTES) -> torch.Tensor:
    """down(act(gate(x)) · up(x)) of ``mlp`` (transformers' ``Qwen2_5_VLMLP``) on zero-padded weights.

    Args:
        mlp: the block's MLP (gate_proj, up_proj: I outputs; down_proj: I inputs; biases optional).
        x: [..., C] in the weights' dtype.
        align_bytes: the padded width I' is a multiple of this many bytes of the weights' dtype.

    Returns:
        [..., C], equal to ``mlp``'s own forward up to the products' rounding (module docstring).
    """
    weight = mlp.gate_proj.weight
    pad = padded_width(weight.shape[0], weight.dtype, align_bytes) - weight.shape[0]
    if pad == 0:
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    gate = PaddedLinear.apply(x, weight, mlp.gate_proj.bias, pad, 0)
    up = PaddedLinear.apply(x, mlp.up_proj.weight, mlp.up_proj.bias, pad, 0)
    return PaddedLinear.apply(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias, 0, pad)


class PaddedLinear(torch.autograd.Function):
    """x·W'ᵀ + b' with W' = W [O, I] zero-padded to [O + out_pad, I + in_pad] and b' = b zero-padded to
    O + out_pad; x is [..., I + in_pad]. Backward keeps x and W itself, not the padded copy, and pads W
    again: the pass holds no more memory than the unpadded product. Gradients are those of
    ``F.linear`` on the padded operands, cut back to W's and b's shapes. Not for autocast regions
    (backward runs on the saved dtypes; rollplex loads models in their training dtype)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_pad: int, in_pad: int):
        ctx.save_for_backward(x, weight)
        ctx.pads, ctx.has_bias = (out_pad, in_pad), bias is not None
        padded_bias = None if bias is None else F.pad(bias, (0, out_pad))
        return F.linear(x, F.pad(weight, (0, in_pad, 0, out_pad)), padded_bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        (out_pad, in_pad), (rows, cols) = ctx.pads, weight.shape
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ F.pad(weight, (0, in_pad, 0, out_pad))
        flat = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = (flat.t() @ x.reshape(-1, x.shape[-1]))[:rows, :cols]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat.sum(0)[:rows]
        return grad_x, grad_weight, grad_bias, None, None


class PaddedVisionMLP(Qwen2_5_VLMLP):
    """``Qwen2_5_VLMLP`` whose forward is ``padded_mlp`` (same parameters; see the module docstring)."""

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        return padded_mlp(self, hidden_state, ALIGN_BYTES)


def set_vision_mlp_padding(model, on: bool) -> int:
    """Run the MLP of every vision block of ``model`` (a Qwen2.5-VL model) padded (``on``) or as
    transformers defines it; returns how many blocks were switched. Blocks whose MLP is of another class,
    or (to pad) whose projections are not plain hook-free ``nn.Linear`` modules, are left alone, with
    one warning per call naming how many."""
    switched, skipped = 0, 0
    for block in model.model.visual.blocks:
        mlp = block.mlp
        if type(mlp) not in (Qwen2_5_VLMLP, PaddedVisionMLP):
            skipped += 1
            continue
        target = PaddedVisionMLP if on and _plain_projections(mlp) else Qwen2_5_VLMLP
        skipped += on and target is Qwen2_5_VLMLP  # e.g. a hook added since it was padded: unpad it
        if type(mlp) is not target:
            mlp.__class__ = target
            switched += 1
    if on and skipped:
        log.warning(
            "vision MLP padding left %d of %d vision blocks unpadded: their MLP is not transformers' "
            "Qwen2_5_VLMLP with plain nn.Linear projections",
            skipped,
            len(model.model.visual.blocks),
        )
    return switched


def _plain_projections(mlp: Qwen2_5_VLMLP) -> bool:
    """Whether gate, up and down are ``nn.Linear`` itself with no forward hooks (the padded forward reads
    their weights directly and would bypass anything else)."""
    return all(
        type(linear) is torch.nn.Linear and not linear._forward_hooks and not linear._forward_pre_hooks
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    )

"""The vision tower's MLP with its intermediate width padded for cuBLAS's Hopper kernels.

Legend: T vision patches, C vision hidden size, I the MLP's intermediate size, I' = I rounded up to a
multiple of ``ALIGN_BYTES`` / element size.

Each vision block of Qwen2.5-VL computes down(SiLU(gate(x)) · up(x)) with I = 3420 for the 3B and 7B
models (3456 for 32B: already aligned). In bf16 a row of 3420 elements is 6,840 bytes, not a multiple
of 16, so the [T, I] activations and the [C, I] down weight have leading dimensions cuBLAS's sm90
kernels cannot take, and the MLP's products fall back to sm80 kernels. A kernel profile of one serial GRPO step of
the 3B benchmark workload on one H200 found 2.40 s of the step's device time in sm80 products, 2.11 s
of it in the vision MLP's forward products and gate/up gradients alone (docs/benchmarks.md).

``PaddedVisionMLP.forward`` runs the same MLP on weights padded with zeros to I' outputs (gate, up and
their biases) and I' inputs (down). The padded units are exactly zero — gate and up give 0 there,
act(0) · 0 = 0, and down's padded columns are 0 — so the output equals the unpadded MLP's up to the
rounding of the products (a different kernel sums in a different order), and the gradients of the
original weights are the padded gradients' unpadded part (the pad is an autograd op). The padded
weight copies are built per call. A pass that keeps activations for backward without activation
checkpointing keeps them until its backward: 3 × C·I' elements per block, 0.84 GB (0.78 GiB) per
tower call of the 3B model in bf16, for every video whose attached prefix is held. Under checkpointing
or without gradients they are transient.

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
    gate = F.linear(x, F.pad(weight, (0, 0, 0, pad)), _pad_bias(mlp.gate_proj.bias, pad))
    up = F.linear(x, F.pad(mlp.up_proj.weight, (0, 0, 0, pad)), _pad_bias(mlp.up_proj.bias, pad))
    return F.linear(mlp.act_fn(gate) * up, F.pad(mlp.down_proj.weight, (0, pad)), mlp.down_proj.bias)


def _pad_bias(bias: torch.Tensor | None, pad: int) -> torch.Tensor | None:
    return None if bias is None else F.pad(bias, (0, pad))


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
    target = PaddedVisionMLP if on else Qwen2_5_VLMLP
    for block in model.model.visual.blocks:
        mlp = block.mlp
        if type(mlp) not in (Qwen2_5_VLMLP, PaddedVisionMLP) or (on and not _plain_projections(mlp)):
            skipped += 1
        elif type(mlp) is not target:
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

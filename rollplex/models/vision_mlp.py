"""The vision tower's MLP with its intermediate width padded for cuBLAS's Hopper kernels.

Legend: T vision patches, C vision hidden size, I the MLP's intermediate size, I' = I rounded up to a
multiple of ``ALIGN_BYTES`` / element size.

Each vision block of Qwen2.5-VL computes down(SiLU(gate(x)) · up(x)) with I = 3420 for the 3B and 7B
models (3456 for 32B: already aligned). In bf16 a row of 3420 elements is 6,840 bytes, not a multiple of 16, so the
[T, I] activations and the [C, I] down weight have leading dimensions cuBLAS's sm90 kernels cannot
take, and every product of the MLP — forward, and in backward both gradients — falls back to sm80
kernels. A kernel profile of one serial GRPO step of the 3B benchmark workload on one H200 found 2.4 s
of the step's device time in those kernels (docs/benchmarks.md).

``PaddedVisionMLP.forward`` runs the same MLP on weights padded with zeros to I' outputs (gate, up and
their biases) and I' inputs (down). The padded units are exactly zero — gate and up give 0 there,
act(0) · 0 = 0, and down's padded columns are 0 — so the output equals the unpadded MLP's up to the
rounding of the products (a different kernel sums in a different order), and the gradients of the
original weights are the padded gradients' unpadded part (the pad is an autograd op). The padded
weight copies are built per call: in a pass that keeps activations for backward without activation
checkpointing they stay alive until backward (3 × C·I' elements per block, 0.84 GB per video for the
3B tower in bf16); under checkpointing or without gradients they are transient.

``set_vision_mlp_padding`` switches a model's vision blocks between the two forwards by swapping their
MLP's class, so parameter names, state dicts and checkpoints are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

ALIGN_BYTES = 16  # leading dimensions cuBLAS's sm90 (TMA) kernels accept are multiples of 16 bytes


def padded_width(width: int, dtype: torch.dtype, align_bytes: int = ALIGN_BYTES) -> int:
    """``width`` rounded up to a multiple of ``align_bytes`` bytes of ``dtype`` (at least one element).

    Raises:
        ValueError: ``align_bytes`` not a positive multiple of the dtype's element size.
    """
    size = torch.empty((), dtype=dtype).element_size()
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
    transformers defines it; returns how many blocks were switched. Blocks whose MLP is of another
    class are left alone."""
    switched = 0
    target = PaddedVisionMLP if on else Qwen2_5_VLMLP
    for block in model.model.visual.blocks:
        if type(block.mlp) in (Qwen2_5_VLMLP, PaddedVisionMLP) and type(block.mlp) is not target:
            block.mlp.__class__ = target
            switched += 1
    return switched

"""Regional compilation of the training-side passes: each layer's norms, attention module and MLP run as
torch.compile'd functions, so their elementwise work (RMSNorm in float32, RoPE, SiLU gate, bias adds,
dtype casts) is fused into a few kernels instead of one kernel per operator.

Why: a kernel profile of one serial GRPO step of the 3B benchmark workload (docs/benchmarks.md) found
3.6 s of the 12.0 s of device time in eager elementwise kernels (``aten::mul`` alone 44,004 calls,
1.44 s), launched one by one from the host: the prefix and suffix passes of the reference and the
actor, their backward and activation-checkpointing's recompute.

What is compiled (PyTorch's "regional compilation": one compiled function per repeated module class,
shared by every layer): in each decoder layer ``input_layernorm``, ``self_attn``,
``post_attention_layernorm`` and ``mlp``; in each vision block ``norm1``, ``attn``, ``norm2`` and
``mlp``. The attention functions themselves (``models.attention``: plans with Python state, chunk
plans read back to the host) stay opaque to torch.compile, so each attention module compiles as its
projections + RoPE, a graph break around the attention call, and its output projection. The residual
adds, embeddings, LM head and the decode step (compiled separately, rollout.decode) are untouched.

Each compiled forward is installed as the module instance's ``forward`` (a bound method of the class's
own forward, compiled), inside any activation checkpoint of the layer, whichever way the transformers
release wraps its layers. ``copy.deepcopy`` of the model gives the copy forwards bound to its own
modules. The numbers are the same operations in inductor's kernels: equal to the eager modules up to
floating-point rounding (tests/models/test_compiled.py; under the ``aot_eager`` backend, which traces
without generating kernels, the log-probs are bitwise the eager ones and the gradients equal to
rounding, since the traced backward formulas may sum in another order).
"""

from __future__ import annotations

import types

import torch

_MARK = "_rollplex_compiled"
_TEXT_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_VISION_PARTS = ("norm1", "attn", "norm2", "mlp")
# Variants per compiled function: text or vision rank × batch of 1 or more × grad mode × dtype, and the
# checkpoint recompute; torch's default of 8 would leave the rest running eagerly.
RECOMPILE_LIMIT = 64
_cache: dict[tuple, object] = {}


def _compiled(forward, backend: str):
    """One compiled function per (class forward, backend), shared by every instance."""
    key = (forward, backend)
    if key not in _cache:
        _cache[key] = torch.compile(forward, backend=backend, dynamic=True)
    return _cache[key]


def _layer_parts(model):
    """(module, part names) of every decoder layer and vision block of a Qwen2.5-VL model."""
    for layer in model.model.language_model.layers:
        yield layer, _TEXT_PARTS
    for block in model.model.visual.blocks:
        yield block, _VISION_PARTS


def set_layer_compilation(model, on: bool, backend: str = "inductor") -> int:
    """Run each layer's norms, attention module and MLP of ``model`` (a Qwen2.5-VL model) compiled
    (``on``) or as transformers defines them; returns how many modules now run compiled. Calling it
    again recompiles for the modules' current classes (models.vision_mlp swaps the vision MLP's class).

    Args:
        backend: torch.compile backend: ``inductor`` (fused kernels) or ``aot_eager`` (traced, run by
            the eager kernels: the same numbers bitwise; for tests).

    Raises:
        ValueError: a module named by the layer layout is missing (not a Qwen2.5-VL model).
    """
    count = 0
    if on:
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
    for owner, parts in _layer_parts(model):
        for name in parts:
            module = getattr(owner, name, None)
            if module is None:
                raise ValueError(f"{type(owner).__name__} has no {name!r}: not a Qwen2.5-VL layer")
            if getattr(module, _MARK, False):
                del module.forward  # back to the class's forward
                delattr(module, _MARK)
            if on:
                module.forward = types.MethodType(_compiled(type(module).forward, backend), module)
                setattr(module, _MARK, True)
                count += 1
    return count

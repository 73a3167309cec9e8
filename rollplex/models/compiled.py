"""Regional compilation of the training-side passes: each layer's norms, attention module and MLP run as
torch.compile'd functions, so their elementwise work (RMSNorm in float32, RoPE, SiLU gate, bias adds,
dtype casts) is fused into a few kernels instead of one kernel per operator.

Why: a kernel profile of one serial GRPO step of the 3B benchmark workload (docs/benchmarks.md) found
up to 3.6 s of the 12.0 s of device time in eager elementwise kernels (``aten::mul`` alone 44,004
calls, 1.44 s), launched one by one from the host: the prefix and suffix passes of the reference and the
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

import functools
import types
from collections.abc import Callable

import torch

_MARK = "_rollplex_compiled"  # on a module: the compiled function its instance ``forward`` is bound to
_TEXT_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_VISION_PARTS = ("norm1", "attn", "norm2", "mlp")
# Cache entries per compiled function, e.g. for the RMSNorm: rank 2 (vision) or 3 (text) × batch 1 or
# more × grad mode and inputs requiring grad × prefix or suffix pass (11-17 counted on the CPU,
# depending on the torch version, whatever the number of layers); torch's default of 8 would leave the
# rest running eagerly, with one warning.
RECOMPILE_LIMIT = 64


def compiles_layers(requested: bool, device: torch.device) -> bool:
    """Whether ``model.compile_layers`` (``requested``) applies on ``device``: CUDA only (on the CPU,
    inductor would need a C++ toolchain and minutes of compilation for the tiny test models)."""
    return requested and device.type == "cuda"


@functools.cache
def _compiled(forward, backend: str | Callable):
    """One compiled function per (class forward, backend), shared by every instance."""
    return torch.compile(forward, backend=backend, dynamic=True)


def _targets(model) -> list[torch.nn.Module]:
    """The norms, attention modules and MLPs of every decoder layer and vision block of ``model``.

    Raises:
        ValueError: ``model`` is not a Qwen2.5-VL model (a layer or a part of one is missing).
    """
    try:
        layers = [(layer, _TEXT_PARTS) for layer in model.model.language_model.layers]
        layers += [(block, _VISION_PARTS) for block in model.model.visual.blocks]
    except AttributeError as err:
        raise ValueError(f"{type(model).__name__} is not a Qwen2.5-VL model: {err}") from None
    modules = []
    for owner, parts in layers:
        for name in parts:
            module = getattr(owner, name, None)
            if module is None:
                raise ValueError(f"{type(owner).__name__} has no {name!r}: not a Qwen2.5-VL layer")
            modules.append(module)
    return modules


def _own_forward(module) -> bool:
    """Whether ``module``'s instance ``forward`` is the compiled one installed here (False: none)."""
    forward, mark = vars(module).get("forward"), getattr(module, _MARK, None)
    return mark is not None and getattr(forward, "__func__", None) is mark


def refuse_foreign_forwards(model) -> None:
    """Check that compiling ``model``'s layers would overwrite no instance ``forward`` of another origin.

    Raises:
        ValueError: a layer module has one (another patch or hook library), named in the message; or
            ``model`` is not a Qwen2.5-VL model.
    """
    foreign = [m for m in _targets(model) if "forward" in vars(m) and not _own_forward(m)]
    if foreign:
        names = {module: name for name, module in model.named_modules()}
        raise ValueError(
            f"compiling the layers would overwrite the instance forward of {names[foreign[0]]} "
            f"({len(foreign)} such module(s)); remove it or set model.compile_layers: false"
        )


def layers_compiled(model) -> bool:
    """Whether ``set_layer_compilation`` has installed compiled forwards on ``model``."""
    return any(_own_forward(m) for m in _targets(model))


def set_layer_compilation(model, on: bool, backend: str | Callable = "inductor") -> int:
    """Run each layer's norms, attention module and MLP of ``model`` (a Qwen2.5-VL model) compiled
    (``on``) or as transformers defines them; returns how many modules now run compiled. Calling it
    again recompiles for the modules' current classes (models.vision_mlp swaps the vision MLP's class).

    Args:
        model: a transformers ``Qwen2_5_VLForConditionalGeneration``.
        on: install the compiled forwards (True) or remove those installed here (False; an instance
            ``forward`` of another origin is left as it is).
        backend: torch.compile backend: ``inductor`` (fused kernels), ``aot_eager`` (traced, run by
            the eager kernels; for tests) or a backend callable.

    Raises:
        ValueError: ``model`` is not a Qwen2.5-VL model, or, turning it on, a module has an instance
            ``forward`` that was not installed here (another patch or hook library; it would be
            overwritten). Nothing is changed then.

    Turning it on raises torch's process-wide ``torch._dynamo.config.recompile_limit`` to at least
    ``RECOMPILE_LIMIT`` (it applies to every compiled function of the process, decode's included).
    """
    modules = _targets(model)
    if on:
        refuse_foreign_forwards(model)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
    for module in modules:
        if _own_forward(module):
            del module.forward  # back to the class's forward
        if getattr(module, _MARK, None) is not None:
            delattr(module, _MARK)
        if on:
            compiled = _compiled(type(module).forward, backend)
            module.forward = types.MethodType(compiled, module)
            setattr(module, _MARK, compiled)
    return len(modules) if on else 0

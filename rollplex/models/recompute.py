"""Activation checkpointing whose forward runs without autograd: layer recompute.

Each checkpointed decoder layer or vision block runs its forward inside one autograd Function, with
autograd off, keeping only the layer's inputs; backward runs the layer again with autograd on and
back-propagates through that recomputation (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost"; the reentrant scheme of ``torch.utils.checkpoint``).

Why not torch's non-reentrant checkpoint, which training used before: its forward builds the layer's
whole autograd graph and passes every tensor the graph saves through Python hooks, which makes the
actor's attached prefix pass host-bound, slower than this way (benchmarks/README.md). A forward without
autograd issues what the detached prefix pass issues.

Why not torch's reentrant checkpoint: a prefill layer has a second output, the boundary keys and
values it records in its ``PrefixPlan``, and the suffix back-propagates into them. Here those are
outputs of the Function: the layer runs against a scratch plan of its own, in forward and again in
backward, and the Function's outputs are what the caller's plan records.

Which layer calls recompute this way (``recomputable``): those with a positional tensor that needs a
gradient and no other tensor that needs one outside the positional arguments — the hidden states of a
prefix pass or a vision block. A suffix layer reads the attached boundary keys and values through its
``SuffixPlan``, a keyword argument; it keeps torch's non-reentrant checkpoint, which tracks such captured
tensors. So do calls whose input needs no gradient (a frozen vision tower's blocks with a trainable
merger) and calls under autocast, whose state the recomputation would not restore.

Like torch's reentrant checkpoint, gradients reach the layer's parameters by a backward inside backward,
so the outer call must be ``Tensor.backward`` / ``torch.autograd.backward`` without ``inputs`` and
without ``create_graph``; otherwise backward raises RuntimeError. The RNG state is not restored for the
recomputation: ``enable`` refuses a model with dropout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from rollplex.models.attention import PLAN_KEYWORD, PrefixPlan


def enable(model, fallback: Callable) -> None:
    """Make every layer that transformers checkpoints (``gradient_checkpointing`` set, as
    ``activation_checkpointing_enable`` leaves it) use layer recompute, and ``fallback`` (a
    ``torch.utils.checkpoint.checkpoint`` with its options) for calls that are not ``recomputable``.

    Raises:
        ValueError: a module of the model has a dropout probability above zero (the recomputation would
            draw other masks than the forward); the message names it.
    """
    dropout = _active_dropout(model)
    if dropout:
        raise ValueError(
            f"layer recompute does not restore the RNG state, and {dropout} has dropout; "
            "set model.layer_recompute: false to checkpoint with torch's checkpoint instead"
        )
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(
            module, "_gradient_checkpointing_func"
        ):
            module._gradient_checkpointing_func = functools.partial(checkpoint, fallback=fallback)


def _active_dropout(model) -> str | None:
    """The name of a module of ``model`` with a dropout probability above zero (a dropout module, or an
    attention module's ``attention_dropout`` rate), or None."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            p = module.p
        else:
            rate = getattr(module, "attention_dropout", 0.0)
            p = rate if isinstance(rate, (int, float)) else 0.0
        if p > 0:
            return name or type(module).__name__
    return None


def checkpoint(function: functools.partial, *args, fallback: Callable):
    """A checkpointed layer call (transformers' ``_gradient_checkpointing_func`` contract: ``function``
    is the layer's call with its keyword arguments bound, ``args`` its positional arguments, the hidden
    states [1, L, Hd] of a decoder layer or [patches, Hv] of a vision block).

    Returns the layer's output (the same shape and dtype), attached to autograd through
    ``_LayerRecompute``; under ``torch.no_grad()`` the layer's own call (transformers 5.17 checkpoints
    there too); where the call is not ``recomputable`` or autocast is on, ``fallback(function, *args)``.
    A prefill layer's boundary keys and values ([1, Hkv, L, D] each) are recorded in the caller's
    ``PrefixPlan`` as outputs of the same Function.

    Raises:
        TypeError: the layer returned something other than a tensor.
        RuntimeError (in backward): the backward is ``torch.autograd.grad``, has ``inputs`` or
            ``create_graph``.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    if _autocast() or not recomputable(function, args):
        return fallback(function, *args)
    keywords = dict(function.keywords)
    plan = keywords.pop(PLAN_KEYWORD) if isinstance(keywords.get(PLAN_KEYWORD), PrefixPlan) else None
    layer = _Layer(function.func, function.args, keywords, prefill=plan is not None)
    recorded: list[int] = []
    out, *boundary = _LayerRecompute.apply(layer, recorded, *args)
    if plan is not None and plan.recording:
        for i, index in enumerate(recorded):
            plan.keys[index], plan.values[index] = boundary[2 * i], boundary[2 * i + 1]
    return out


def _autocast() -> bool:
    """Whether autocast is on for CUDA or the CPU (the recomputation would run without it)."""
    return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")


def recomputable(function, args: tuple) -> bool:
    """Whether a checkpointed call can use layer recompute: ``function`` is a ``functools.partial``,
    every positional argument is a tensor and one of them needs a gradient, and no keyword argument
    holds a tensor that needs one (a ``PrefixPlan`` is replaced by the layer's own, so it is not
    looked into)."""
    if not isinstance(function, functools.partial) or not args:
        return False
    if not all(isinstance(a, torch.Tensor) for a in args) or not any(a.requires_grad for a in args):
        return False
    return not any(
        _needs_grad(v)
        for k, v in function.keywords.items()
        if not (k == PLAN_KEYWORD and isinstance(v, PrefixPlan))
    )


def _needs_grad(value) -> bool:
    """Whether ``value`` is, or holds (in lists, tuples, dicts and dataclass fields), a tensor that
    needs a gradient."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_needs_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_needs_grad(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_needs_grad(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


@dataclasses.dataclass(frozen=True)
class _Layer:
    """A layer call without the caller's prefix plan: ``run`` binds a fresh one, so that neither the
    forward nor the recomputation writes into the caller's plan, and the Function keeps no reference
    to it."""

    func: Callable
    args: tuple
    keywords: dict  # without a prefix plan
    prefill: bool  # the call had a prefix plan, for which ``run`` binds its own

    def run(self, inputs) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """(output, boundary keys by layer index, boundary values by layer index) of the layer on
        ``inputs``; the dicts are empty for a layer without a prefix plan."""
        plan = PrefixPlan()
        keywords = {**self.keywords, PLAN_KEYWORD: plan} if self.prefill else self.keywords
        out = self.func(*self.args, *inputs, **keywords)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"layer recompute expects a layer to return a tensor, got {type(out).__name__}")
        return out, plan.keys, plan.values


def _outputs(out: torch.Tensor, keys: dict, values: dict) -> tuple[torch.Tensor, ...]:
    """The Function's outputs: the layer's output, then keys and values in layer order, interleaved."""
    return (out, *[t for index in sorted(keys) for t in (keys[index], values[index])])


class _LayerRecompute(torch.autograd.Function):
    """forward(layer, recorded, *inputs) → (output, key, value, …): the layer without autograd, keeping
    ``inputs``; the recorded layer indices are appended to ``recorded``. backward recomputes the layer
    with autograd and back-propagates the gradients of every output that received one."""

    @staticmethod
    def forward(ctx, layer: _Layer, recorded: list[int], *inputs):
        ctx.layer = layer
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)
        out, keys, values = layer.run(inputs)
        recorded.extend(sorted(keys))
        return _outputs(out, keys, values)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid() or torch.is_grad_enabled():
            raise RuntimeError(
                "layer recompute supports Tensor.backward / torch.autograd.backward without inputs and "
                "without create_graph, not torch.autograd.grad"
            )
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = _outputs(*ctx.layer.run(inputs))
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(x.grad if x.requires_grad else None for x in inputs))

"""Regional compilation of the training-side passes: each decoder layer and vision block (scope
``layer``), or each one's norms, attention module and MLP (scope ``parts``), run as torch.compile'd
functions, so their elementwise work (RMSNorm in float32, RoPE, SiLU gate, bias adds, residual adds,
dtype casts) is fused into a few kernels instead of one kernel per operator.

Why: in a kernel profile of one serial GRPO step of the benchmark workload (benchmarks/README.md),
eager elementwise kernels, launched one by one from the host, take a large share of the device time:
the prefix and suffix passes of the reference and the actor, their backward and
activation-checkpointing's recompute.

What is compiled (PyTorch's "regional compilation": one compiled function per repeated module class,
shared by every layer): with scope ``layer`` (the default), each decoder layer's and vision block's
forward; with scope ``parts``, in each decoder layer ``input_layernorm``, ``self_attn``,
``post_attention_layernorm`` and ``mlp``, and in each vision block ``norm1``, ``attn``, ``norm2`` and
``mlp``. The attention functions themselves (``models.attention``: plans with Python state, chunk
plans read back to the host) stay opaque to torch.compile, so a layer compiles as a few graphs around
the attention call: two where torch's ``nested_graph_breaks`` resumes tracing inside the attention
module, four where the break reaches the layer's frame (torch without that option, and with it for
the text layers on torch 2.14 with transformers 5.25); scope ``parts``: five, plus the residual adds
run eagerly. The count is torch's choice; the tests hold that it does not grow with calls or layers.
Embeddings, the LM head and the decode step (compiled separately, rollout.decode) are untouched.

Why ``layer`` is the default: the prefix passes and the vision backward of the benchmark workload are
bound by the host's pace of launching work, not the device (benchmarks/README.md), and
every compiled graph costs the host its own wrapper, guards and autograd node in forward,
recomputation and backward. Two to four graphs per layer instead of five, and the residual adds fused, cut
that cost.

Newer transformers releases checkpoint a layer inside its class ``forward``; there the layer's own
forward is compiled and checkpointed around, as those releases do it (a checkpoint inside a compiled
function, around the opaque attention call, would leave the layer uncompiled in every pass with
gradients). Where the first compiled call cannot be compiled at all (no C compiler, no Triton), every
compiled layer of the process runs uncompiled from then on, after one warning (``compile_fallback``);
``compiled_scope`` still reports the scope installed.

Each compiled forward is installed as the module instance's ``forward`` (a bound method of the class's
own forward, compiled), inside any activation checkpoint of the layer, whichever way the transformers
release wraps its layers. ``copy.deepcopy`` of the model gives the copy forwards bound to its own
modules. The numbers are the same operations in inductor's kernels: equal to the eager modules up to
floating-point rounding (tests/models/test_compiled.py; under the ``aot_eager`` backend, which traces
without generating kernels, the log-probs are bitwise the eager ones and the gradients equal to
rounding, since the traced backward formulas may sum in another order).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from collections.abc import Callable

import torch

from rollplex.config import COMPILE_SCOPES as SCOPES  # model.compile_scope

log = logging.getLogger("rollplex")

_MARK = "_rollplex_compiled"  # on a module: the compiled function its instance ``forward`` is bound to
_TEXT_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_VISION_PARTS = ("norm1", "attn", "norm2", "mlp")
# The attention call breaks the graph inside the attention module, a frame nested in the layer's. With
# torch's ``nested_graph_breaks`` (in recent releases) tracing can resume inside that frame: two graphs per
# layer. Where the break reaches the layer's frame, the attention module's frame compiles apart: four.
NESTED_GRAPH_BREAKS = hasattr(torch._dynamo.config, "nested_graph_breaks")
# Cache entries per compiled function, one per variant of its inputs, e.g. under ``parts`` for the
# RMSNorm: rank 2 (vision) or 3 (text) × batch 1 or more × grad mode and inputs requiring grad × prefix
# or suffix pass (11-17 counted on the CPU, depending on the torch version, whatever the number of
# layers); under ``layer`` the same variants of a layer and of the code after its attention call.
# torch's default of 8 would leave the rest running eagerly, with one warning.
RECOMPILE_LIMIT = 64


def compiles_layers(requested: bool, device: torch.device) -> bool:
    """Whether ``model.compile_layers`` (``requested``) applies on ``device``: CUDA only (on the CPU,
    inductor would need a C++ toolchain and minutes of compilation for the tiny test models)."""
    return requested and device.type == "cuda"


# Inductor rounds to the low-precision dtype wherever eager PyTorch does. Without it, a value fused into
# its consumer can be used unrounded, and whether it is depends on the graph: a training graph saves the
# residual sum for backward (rounded), an inference graph can feed it straight into the next norm. The
# detached and attached prefix passes of one prompt then differed in bf16 on a GPU, and prefill fusion
# (the attached pass seeding decode) no longer gave the serial schedule's update bitwise.
_INDUCTOR_OPTIONS = {"emulate_precision_casts": True}


@dataclasses.dataclass
class _CompileState:
    """Whether this process's compiled layers work. A machine where torch.compile cannot build kernels
    (no C compiler, no Triton) fails the same way for every layer, at the first compiled call: the
    first failure is kept in ``fallback`` ("Type: message"), and every compiled layer runs its class's
    own forward from then on. A failure after a compiled call has returned (``compiled_once``) is raised
    instead: it is not the machine, and running on uncompiled would break activation checkpointing,
    whose recomputation must save what the compiled forward saved."""

    fallback: str | None = None
    compiled_once: bool = False


_STATE = _CompileState()  # one per process, like the machine it describes


def compile_fallback() -> str | None:
    """Why the layers run uncompiled although compilation was turned on (None: they run compiled)."""
    return _STATE.fallback


def compile_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when a backend fails to compile a graph."""
    import torch._dynamo.exc

    errors: list[type[BaseException]] = [torch._dynamo.exc.BackendCompilerFailed]
    try:
        from torch._inductor.exc import InductorError
    except ImportError:
        pass
    else:
        errors.append(InductorError)
    return tuple(errors)


def compile_error_text(err: BaseException) -> str:
    """One line naming a compile error: the backend's own error (``inner_exception``) where it has one,
    its type and the first line of its message (which may be empty)."""
    cause = getattr(err, "inner_exception", None) or err
    return f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"


def _checkpointing_inner(forward) -> Callable | None:
    """The layer's own forward where ``forward`` is the wrapper with which newer transformers releases
    checkpoint a layer inside its ``forward`` (``forward_with_checkpointing``); None where the release
    checkpoints around the call instead (``GradientCheckpointingLayer.__call__``)."""
    inner = getattr(forward, "__wrapped__", None)
    code = getattr(forward, "__code__", None)
    named = code is not None and code.co_name == "forward_with_checkpointing"
    return inner if inner is not None and named else None


@functools.cache
def _compiled(forward, backend: str | Callable):
    """One compiled function per (class forward, backend), shared by every instance: ``forward``
    compiled, falling back to ``forward`` itself, with one warning, if compiling fails before any
    compiled call has succeeded (``_CompileState``; a later failure is raised). The returned function keeps
    ``forward`` as ``.eager``.

    Where ``forward`` checkpoints the layer itself (``_checkpointing_inner``), the layer's own forward is
    compiled and checkpointed here the way transformers does it: compiled, the checkpoint would hold the
    opaque attention call, which torch.compile cannot trace inside a checkpoint, and the whole layer
    would run uncompiled in every pass with gradients."""
    options = _INDUCTOR_OPTIONS if backend == "inductor" else None
    inner = _checkpointing_inner(forward)
    compiled = torch.compile(inner or forward, backend=backend, dynamic=True, options=options)

    def run(self, *args, **kwargs):
        if inner is not None and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(functools.partial(compiled, self, **kwargs), *args)
        return compiled(self, *args, **kwargs)

    def guarded(self, *args, **kwargs):
        if _STATE.fallback is None:
            try:
                out = run(self, *args, **kwargs)
            except compile_errors() as err:
                if _STATE.compiled_once:
                    raise
                _STATE.fallback = compile_error_text(err)
                log.warning(
                    "compiling the layers failed (%s); they run uncompiled from here on "
                    "(model.compile_layers: false skips compiling)",
                    _STATE.fallback,
                )
            else:
                _STATE.compiled_once = True
                return out
        return forward(self, *args, **kwargs)

    guarded.eager = forward
    return guarded


def check_scope(scope: str) -> None:
    """Check that ``scope`` is a compile scope (``model.compile_scope``).

    Raises:
        ValueError: ``scope`` is not one of ``SCOPES``.
    """
    if scope not in SCOPES:
        raise ValueError(f"compile scope {scope!r}: expected one of {SCOPES}")


def _targets(model, scope: str) -> list[torch.nn.Module]:
    """The modules compiled under ``scope``: every decoder layer and vision block of ``model``
    (``layer``), or their norms, attention modules and MLPs (``parts``).

    Raises:
        ValueError: ``model`` is not a Qwen2.5-VL model (a layer or a part of one is missing), or an
            unknown ``scope``.
    """
    check_scope(scope)
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
            if scope == "parts":
                modules.append(module)
        if scope == "layer":
            modules.append(owner)
    return modules


def _own_forward(module) -> bool:
    """Whether ``module``'s instance ``forward`` is the compiled one installed here (False: none)."""
    forward, mark = vars(module).get("forward"), getattr(module, _MARK, None)
    return mark is not None and getattr(forward, "__func__", None) is mark


def refuse_foreign_forwards(model, scope: str = "layer") -> None:
    """Check that compiling ``model``'s layers under ``scope`` would overwrite no instance ``forward`` of
    another origin.

    Raises:
        ValueError: a module to compile has one (another patch or hook library), named in the message;
            ``model`` is not a Qwen2.5-VL model; or an unknown ``scope``.
    """
    foreign = [m for m in _targets(model, scope) if "forward" in vars(m) and not _own_forward(m)]
    if foreign:
        names = {module: name for name, module in model.named_modules()}
        raise ValueError(
            f"compiling the layers would overwrite the instance forward of {names[foreign[0]]} "
            f"({len(foreign)} such module(s)); remove it or set model.compile_layers: false"
        )


def compiled_scope(model) -> str | None:
    """The scope ``set_layer_compilation`` installed compiled forwards on ``model`` under (None: none).

    Raises:
        ValueError: ``model`` is not a Qwen2.5-VL model.
    """
    for scope in SCOPES:
        if any(_own_forward(m) for m in _targets(model, scope)):
            return scope
    return None


def layers_compiled(model) -> bool:
    """Whether ``set_layer_compilation`` has installed compiled forwards on ``model``."""
    return compiled_scope(model) is not None


def set_layer_compilation(model, on: bool, backend: str | Callable = "inductor", scope: str = "layer") -> int:
    """Run ``model``'s (a Qwen2.5-VL model's) decoder layers and vision blocks (``scope`` ``layer``),
    or their norms, attention modules and MLPs (``parts``), compiled (``on``), or every module as
    transformers defines it; returns how many modules now run compiled. Calling it again removes what
    it installed before, under either scope, and recompiles for the modules' current classes
    (models.vision_mlp swaps the vision MLP's class).

    Args:
        model: a transformers ``Qwen2_5_VLForConditionalGeneration``.
        on: install the compiled forwards (True) or remove those installed here (False; an instance
            ``forward`` of another origin is left as it is).
        backend: torch.compile backend: ``inductor`` (fused kernels), ``aot_eager`` (traced, run by
            the eager kernels; for tests) or a backend callable.
        scope: ``layer`` (a few graphs per layer, around its attention call) or ``parts`` (five,
            the residual adds eager); checked, but otherwise unused, when turning it off.

    Raises:
        ValueError: ``model`` is not a Qwen2.5-VL model, an unknown ``scope``, or, turning it on, a
            module to compile has an instance ``forward`` that was not installed here (another patch
            or hook library; it would be overwritten). Nothing is changed then.

    Turning it on raises torch's process-wide ``torch._dynamo.config.recompile_limit`` to at least
    ``RECOMPILE_LIMIT``, and with scope ``layer`` sets its ``nested_graph_breaks`` where the torch
    release has it. Both apply to every compiled function of the process, decode's included, and both
    stay set when compilation is turned off or switched to ``parts``.
    """
    modules = _targets(model, scope)
    if on:
        refuse_foreign_forwards(model, scope)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
        if scope == "layer" and NESTED_GRAPH_BREAKS:
            torch._dynamo.config.nested_graph_breaks = True
    for module in {id(m): m for s in SCOPES for m in _targets(model, s)}.values():
        if _own_forward(module):
            del module.forward  # back to the class's forward
        if getattr(module, _MARK, None) is not None:
            delattr(module, _MARK)
    if not on:
        return 0
    for module in modules:
        compiled = _compiled(type(module).forward, backend)
        module.forward = types.MethodType(compiled, module)
        setattr(module, _MARK, compiled)
    return len(modules)

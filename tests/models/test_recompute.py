"""Layer recompute (models.recompute): the attached prefix pass keeps no autograd graph inside its
layers, gives the pass without checkpointing's outputs bitwise, and which calls take which path.

Its gradients against the pass without checkpointing (float64, every parameter, vision included) are
in tests/numerics/test_prefix_suffix.py (``test_gradient_checkpointing_changes_no_gradient``); the
same update across schedules with checkpointing on is in tests/schedule/test_same_update.py.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from rollplex.models import recompute
from rollplex.models.attention import PLAN_KEYWORD, PrefixPlan, SuffixPlan
from rollplex.models.forward import enable_checkpointing, prefix_states
from tests.numerics.conftest import BANNED, make_prompt, models  # noqa: F401  (fixture)

PROMPT = make_prompt([3, 2], [("video", (4, 4, 4), 0.5)], seed=2)


def _graph(roots: list[torch.Tensor]) -> set:
    """Every autograd node reachable from ``roots``."""
    seen, stack = set(), [r.grad_fn for r in roots]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack += [child for child, _ in node.next_functions]
    return seen


def _layer_parameters(model) -> set[int]:
    blocks = [*model.model.language_model.layers, *model.model.visual.blocks]
    return {id(p) for block in blocks for p in block.parameters()}


def _attached_pass(model, checkpointing: str):
    m = copy.deepcopy(model).requires_grad_(True)
    m.train(True)
    if checkpointing != "off":
        enable_checkpointing(m, layer_recompute=checkpointing == "recompute")
    (state,) = prefix_states(m, [PROMPT], temperature=0.7, banned_ids=BANNED, attached=True)
    return m, state


@pytest.mark.parametrize("checkpointing", ["recompute", "torch"])
def test_attached_prefix_keeps_one_node_per_layer(models, checkpointing):  # noqa: F811
    """Under layer recompute the graph of an attached prefix pass holds one node per decoder layer and
    vision block and reaches none of their parameters (they are reached by the recomputation in
    backward); its log-probs and boundary keys and values are bitwise those of the pass without
    checkpointing. Torch's checkpoint, the other path, builds each layer's graph in forward."""
    _, plain = _attached_pass(models[0], "off")
    m, state = _attached_pass(models[0], checkpointing)
    nodes = _graph([state.last_logprobs, *state.keys, *state.values])
    layer_nodes = [n for n in nodes if n.name() == "_LayerRecomputeBackward"]
    reached = {id(n.variable) for n in nodes if hasattr(n, "variable")}
    if checkpointing == "recompute":
        assert len(layer_nodes) == len(m.model.language_model.layers) + len(m.model.visual.blocks)
        assert not reached & _layer_parameters(m)
    else:
        assert not layer_nodes and _layer_parameters(m) <= reached
    assert torch.equal(state.last_logprobs, plain.last_logprobs)
    for mine, theirs in zip([*state.keys, *state.values], [*plain.keys, *plain.values], strict=True):
        assert torch.equal(mine, theirs)


def test_autograd_grad_is_refused(models):  # noqa: F811
    """Parameters get their gradients by a backward inside backward, which ``torch.autograd.grad`` would
    not return: it raises instead of returning gradients without them."""
    m, state = _attached_pass(models[0], "recompute")
    with pytest.raises(RuntimeError, match="not torch.autograd.grad"):
        torch.autograd.grad(state.keys[-1].sum(), m.model.language_model.embed_tokens.weight)


def test_recomputable_calls():
    """Layer recompute takes a bound layer call whose tensors that need a gradient are all positional;
    a prefix plan is its own, so what it recorded does not count; anything else goes to the fallback."""
    x = torch.zeros(2, requires_grad=True)
    attached = torch.zeros(2, requires_grad=True)

    def layer(h, **_):
        return h

    prefix = PrefixPlan(keys={0: attached}, values={0: attached})
    assert recompute.recomputable(functools.partial(layer, **{PLAN_KEYWORD: prefix}), (x,))
    assert recompute.recomputable(functools.partial(layer, position_embeddings=(x.detach(),)), (x,))
    suffix = SuffixPlan([attached], [attached], torch.zeros(1), 1)
    assert not recompute.recomputable(functools.partial(layer, **{PLAN_KEYWORD: suffix}), (x,))
    assert not recompute.recomputable(functools.partial(layer, position_embeddings=(attached,)), (x,))
    assert not recompute.recomputable(functools.partial(layer), (x.detach(),))  # nothing needs a gradient
    assert not recompute.recomputable(functools.partial(layer), (x, 1))
    assert not recompute.recomputable(layer, (x,))


def test_the_fallback_takes_what_recompute_cannot():
    """Calls that are not recomputable, and calls under autocast (whose state the recomputation would
    not restore), go to the fallback with the same function and arguments."""
    calls = []

    def fallback(function, *args):
        calls.append((function, args))
        return function(*args)

    x = torch.ones(2, requires_grad=True)
    detached = x.detach()  # nothing needs a gradient
    function = functools.partial(torch.mul, other=2.0)
    out = recompute.checkpoint(function, detached, fallback=fallback)
    assert torch.equal(out, torch.full((2,), 2.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        recompute.checkpoint(function, x, fallback=fallback)
    assert [f is function for f, _ in calls] == [True, True]
    assert [len(a) == 1 and a[0] is b for (_, a), b in zip(calls, (detached, x), strict=True)] == [True, True]


def test_a_suffix_plan_without_attached_tensors_reaches_the_layer():
    """A suffix plan whose boundary needs no gradient (detached keys and values) leaves the call
    recomputable, and the layer receives it, in forward and in the recomputation; a prefix plan is
    replaced by the layer's own."""
    seen = []

    def layer(h, **keywords):
        seen.append(keywords[PLAN_KEYWORD])
        return h * 2.0

    suffix = SuffixPlan([torch.zeros(2)], [torch.zeros(2)], torch.zeros(1), 1)
    x = torch.ones(2, requires_grad=True)
    out = recompute.checkpoint(functools.partial(layer, **{PLAN_KEYWORD: suffix}), x, fallback=None)
    out.sum().backward()
    assert [plan is suffix for plan in seen] == [True, True] and torch.equal(x.grad, torch.full((2,), 2.0))
    prefix = PrefixPlan()
    recompute.checkpoint(functools.partial(layer, **{PLAN_KEYWORD: prefix}), x, fallback=None)
    assert isinstance(seen[-1], PrefixPlan) and seen[-1] is not prefix


def test_without_autograd_the_layer_runs_as_it_is():
    """Under ``torch.no_grad()`` (transformers 5.17 checkpoints there too) the layer is called directly,
    with the caller's plan."""
    seen = []
    prefix = PrefixPlan()
    function = functools.partial(lambda h, **kw: seen.append(kw[PLAN_KEYWORD]) or h, **{PLAN_KEYWORD: prefix})
    with torch.no_grad():
        recompute.checkpoint(function, torch.ones(2, requires_grad=True), fallback=None)
    assert len(seen) == 1 and seen[0] is prefix


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_misuse_raises():
    """A layer that returns something other than a tensor, and a backward with ``create_graph`` (whose
    second-order terms the recomputation would not build), raise."""
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError, match="return a tensor, got tuple"):
        recompute.checkpoint(functools.partial(lambda h: (h * 2.0,)), x, fallback=None)
    out = recompute.checkpoint(functools.partial(lambda h: h * h), x, fallback=None)
    with pytest.raises(RuntimeError, match="without create_graph"):
        out.sum().backward(create_graph=True)


def test_dropout_is_refused(models):  # noqa: F811
    """The recomputation does not restore the RNG state, so a model with dropout is refused, by name
    (attention dropout rates and every dropout module); dropout modules with p = 0 are not."""
    m = copy.deepcopy(models[0])
    m.model.language_model.layers[1].self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="layers.1.self_attn has dropout; set model.layer_recompute: false"):
        enable_checkpointing(m)
    enable_checkpointing(m, layer_recompute=False)  # torch's checkpoint restores it
    m.model.language_model.layers[1].self_attn.attention_dropout = torch.nn.Dropout(0.0)
    enable_checkpointing(m)
    m.model.visual.blocks[0].mlp.extra = torch.nn.Dropout1d(0.3)
    with pytest.raises(ValueError, match="blocks.0.mlp.extra has dropout"):
        enable_checkpointing(m)


def test_enabling_again_stacks_no_hook(models):  # noqa: F811
    """Each call re-enables transformers' checkpointing (the bench switches the layer function per row);
    the model holds as many forward hooks as after the first call, however many calls follow."""

    def hooks(model) -> list:
        return [h for module in model.modules() for h in module._forward_hooks.values()]

    m = copy.deepcopy(models[0]).requires_grad_(False)  # frozen embeddings: transformers hooks their output
    enable_checkpointing(m)
    first = hooks(m)
    assert first
    for layer_recompute in (False, True, True):
        enable_checkpointing(m, layer_recompute=layer_recompute)
    assert len(hooks(m)) == len(first)

"""Prefix + suffix == full sequence: log-probs (≤ 1e-10 abs) and gradients (≤ 1e-9 rel), float64.

docs/numerics.md, the first rows. Cases: images and videos with different second_per_grid_ts, text-only
prompts mixed with video prompts (B15 a), multi-image prompts in either order (B15 b), several groups of
different prompt lengths in one batch, responses of length 1 and of the full budget, a response
containing a vision placeholder id (B05), consecutive calls with different layouts (B01).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from rollplex.models.attention import SuffixAttention
from rollplex.models.forward import (
    enable_checkpointing,
    merge_prefixes,
    prefix_forward,
    prefix_states,
    suffix_logprobs,
)
from tests.numerics.conftest import BANNED, IMAGE, V_START, VIDEO, full_logprobs, make_prompt

N, R, T = 3, 6, 0.7


def _batch():
    prompts = [
        make_prompt([4, 3], [("image", (1, 4, 6), 0.0)], seed=1),  # Layout A (start/end tokens count as text)
        make_prompt([3, 2], [("video", (4, 4, 4), 0.5)], seed=2),
        make_prompt([12], [], seed=3),  # text only (B15)
        make_prompt([2, 3, 1], [("video", (2, 4, 6), 1.5), ("image", (1, 8, 8), 0.0)], seed=4),
    ]
    g = torch.Generator().manual_seed(5)
    responses = torch.randint(3, 150, (len(prompts) * N, R), generator=g)
    lens = torch.tensor([R, 1, 4, 2, R, 5, 1, 3, R, 6, 2, 4])
    return prompts, responses, lens


def _oracle_rows(oracle, prompts, responses, lens, banned=BANNED):
    return [
        full_logprobs(oracle, prompts[b // N], responses[b, : lens[b]], T, banned)
        for b in range(responses.shape[0])
    ]


BACKENDS = pytest.mark.parametrize("backend", ["dense", "causal", "cascade", "sdpa"])


@BACKENDS
def test_suffix_logprobs_match_full_sequence(models, backend):
    model, oracle = models
    prompts, responses, lens = _batch()
    prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=False)
    got, _ = suffix_logprobs(
        model, prefix, responses, group_size=N, temperature=T, banned_ids=BANNED,
        attention=SuffixAttention(backend),
    )  # fmt: skip
    with torch.no_grad():
        want = _oracle_rows(oracle, prompts, responses, lens)
    for b, ref in enumerate(want):
        assert torch.isfinite(got[b, : lens[b]]).all()
        assert (got[b, : lens[b]] - ref).abs().max() <= 1e-10, b


def test_placeholder_ids_in_responses_are_plain_text(models):
    """B05: vision placeholder ids inside a response get no vision feature and sequential positions; with
    the ban lifted their log-probs are finite and match the oracle; with the ban they are exactly -inf
    (the sampler can never produce them, see tests/rollout)."""
    model, oracle = models
    prompts, responses, lens = _batch()
    responses[1, 2], responses[4, 0], responses[7, 3] = IMAGE, V_START, VIDEO
    no_ban = torch.tensor([], dtype=torch.long)
    prefix = prefix_forward(model, prompts, temperature=T, banned_ids=no_ban, attached=False)
    got, _ = suffix_logprobs(model, prefix, responses, group_size=N, temperature=T, banned_ids=no_ban)
    with torch.no_grad():
        want = _oracle_rows(oracle, prompts, responses, lens, no_ban)
    for b, ref in enumerate(want):
        assert torch.isfinite(got[b, : lens[b]]).all()
        assert (got[b, : lens[b]] - ref).abs().max() <= 1e-10, b
    prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=False)
    banned, _ = suffix_logprobs(model, prefix, responses, group_size=N, temperature=T, banned_ids=BANNED)
    assert banned[1, 2] == banned[4, 0] == banned[7, 3] == float("-inf")


def test_multi_image_prompts_keep_their_own_images_in_any_order(models):
    """B15 (b): S0 holds two images (grids (1, 4, 4) and (1, 2, 2): 20 pixel rows, 5 placeholders), S1
    one ((1, 4, 6): 24 rows, 6 placeholders). Pixel rows and grids travel with their prompt, never split
    per image across the batch, so a batch in either order scores every response as the full-sequence
    oracle does for its own prompt alone."""
    model, oracle = models
    s0 = make_prompt([3, 2, 2], [("image", (1, 4, 4), 0.0), ("image", (1, 2, 2), 0.0)], seed=11)
    s1 = make_prompt([4, 3], [("image", (1, 4, 6), 0.0)], seed=12)
    assert s0.pixel_values.shape[0] == 20 and s0.image_grid_thw.tolist() == [[1, 4, 4], [1, 2, 2]]
    assert s1.pixel_values.shape[0] == 24 and s1.image_grid_thw.tolist() == [[1, 4, 6]]
    assert [int((p.input_ids == IMAGE).sum()) for p in (s0, s1)] == [5, 6]
    g = torch.Generator().manual_seed(13)
    responses = [torch.randint(3, 150, (N, R), generator=g) for _ in range(2)]
    with torch.no_grad():
        want = [[full_logprobs(oracle, p, r[n], T) for n in range(N)] for p, r in zip((s0, s1), responses)]
    for order in ([0, 1], [1, 0]):
        prompts = [(s0, s1)[i] for i in order]
        prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=False)
        batch = torch.cat([responses[i] for i in order])
        got, _ = suffix_logprobs(model, prefix, batch, group_size=N, temperature=T, banned_ids=BANNED)
        for slot, i in enumerate(order):
            for n in range(N):
                assert (got[slot * N + n] - want[i][n]).abs().max() <= 1e-10, (order, i, n)


def test_no_layout_state_leaks_between_calls(models):
    """B01: a second batch with other layouts gives the same numbers as when run alone."""
    model, _ = models
    first, responses, _ = _batch()
    other = [make_prompt([2, 1], [("image", (1, 8, 8), 0.0)], seed=9)]  # Layout B
    other_resp = responses[:N]
    alone = prefix_forward(model, other, temperature=T, banned_ids=BANNED, attached=False)
    want, _ = suffix_logprobs(model, alone, other_resp, group_size=N, temperature=T, banned_ids=BANNED)
    prefix_forward(model, first, temperature=T, banned_ids=BANNED, attached=False)
    again = prefix_forward(model, other, temperature=T, banned_ids=BANNED, attached=False)
    got, _ = suffix_logprobs(model, again, other_resp, group_size=N, temperature=T, banned_ids=BANNED)
    assert int(again.next_position[0]) == 9  # Layout B: first response position 9 on all axes
    assert torch.equal(got, want)


def _loss(rows_logprobs: list[torch.Tensor]) -> torch.Tensor:
    weights = torch.linspace(-1.0, 1.5, len(rows_logprobs), dtype=torch.float64)
    return sum(w * lp.sum() for w, lp in zip(weights, rows_logprobs))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_gradients(model, oracle, trainable_vision: bool, backend: str = "auto"):
    prompts, responses, lens = _batch()
    for m in (model, oracle):
        m.zero_grad(set_to_none=True)
        m.requires_grad_(True)
        m.model.visual.requires_grad_(trainable_vision)
    prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=True)
    got, _ = suffix_logprobs(
        model, prefix, responses, group_size=N, temperature=T, banned_ids=BANNED,
        attention=SuffixAttention(backend),
    )  # fmt: skip
    _loss([got[b, : lens[b]] for b in range(len(lens))]).backward()
    _loss(_oracle_rows(oracle, prompts, responses, lens)).backward()
    mine, ref = _grads(model), _grads(oracle)
    assert mine.keys() == ref.keys()
    for name, g in ref.items():
        rel = (mine[name] - g).norm() / g.norm().clamp_min(1e-300)
        assert rel <= 1e-9, (name, float(rel))
    return mine


@BACKENDS
def test_gradients_match_full_sequence_including_vision(models, backend):
    mine = _check_gradients(*models, trainable_vision=True, backend=backend)
    assert any(n.startswith("model.visual.blocks.0") for n in mine)
    assert any(n.startswith("model.visual.merger") for n in mine)
    assert all(float(g.abs().max()) > 0 for n, g in mine.items() if n.startswith("model.visual.merger"))


def test_frozen_vision_gets_no_grad_and_keeps_no_graph(models):
    """B17: with the tower frozen no vision parameter gets a .grad and no vision activations are kept."""
    model, oracle = models
    mine = _check_gradients(model, oracle, trainable_vision=False)
    assert not any(n.startswith("model.visual") for n in mine)
    model.model.visual.requires_grad_(True)
    oracle.model.visual.requires_grad_(True)


def _vision_setting_grads(model, setting: str, checkpointing: bool):
    """Gradients of one backward with the vision tower "trainable", "merger" (blocks frozen, merger
    trainable) or "frozen", whether the tower's output carried an autograd graph, and how many times
    the first vision block's first norm ran during the backward pass (the block's recomputation under
    checkpointing; a forward hook on the block itself does not see the tower's own block calls)."""

    m = copy.deepcopy(model)
    if checkpointing:
        enable_checkpointing(m)
    m.zero_grad(set_to_none=True)
    m.requires_grad_(True)
    m.model.visual.requires_grad_(setting == "trainable")
    m.model.visual.merger.requires_grad_(setting != "frozen")
    graphs = []
    hook = m.model.visual.register_forward_hook(lambda mod, args, out: graphs.append(_has_graph(out)))
    block_runs = []
    counter = m.model.visual.blocks[0].norm1.register_forward_hook(lambda *_: block_runs.append(1))
    prompts, responses, lens = _batch()
    prefix = prefix_forward(m, prompts, temperature=T, banned_ids=BANNED, attached=True)
    got, _ = suffix_logprobs(m, prefix, responses, group_size=N, temperature=T, banned_ids=BANNED)
    before = len(block_runs)
    _loss([got[b, : lens[b]] for b in range(len(lens))]).backward()
    hook.remove()
    counter.remove()
    grads = _grads(m)
    assert grads.keys() == {n for n, p in m.named_parameters() if p.requires_grad}  # none without a grad
    return grads, any(graphs), len(block_runs) - before


def _has_graph(out) -> bool:
    tensors = (
        [out]
        if torch.is_tensor(out)
        else [t for t in getattr(out, "values", lambda: [])() if torch.is_tensor(t)]
    )
    tensors = tensors or [t for t in (out if isinstance(out, tuple) else ()) if torch.is_tensor(t)]
    return any(t.grad_fn is not None for t in tensors)


def test_b17_vision_settings_under_checkpointing(models):
    """B17's three settings, with activation checkpointing on: the trainable vision blocks are recomputed
    in the backward pass (and nothing is without checkpointing); every trainable vision parameter gets a
    nonzero gradient equal to the run without checkpointing; frozen blocks get no .grad, a frozen tower
    returns no autograd graph; the language model's gradients are the same in all three."""
    runs = {
        s: _vision_setting_grads(models[0], s, checkpointing=True) for s in ("trainable", "merger", "frozen")
    }
    plain = {s: _vision_setting_grads(models[0], s, checkpointing=False) for s in ("trainable", "merger")}
    (trainable, graph_t, recomputed), (merger, graph_m, _), (frozen, graph_f, _) = (
        runs["trainable"],
        runs["merger"],
        runs["frozen"],
    )
    assert recomputed > 0 and plain["trainable"][2] == 0  # checkpointing does recompute the blocks
    plain = {s: grads for s, (grads, _, _) in plain.items()}
    assert any(n.startswith("model.visual.blocks") for n in trainable) and graph_t and graph_m and not graph_f
    assert any(n.startswith("model.visual.merger") for n in merger)
    assert not any(n.startswith("model.visual.blocks") for n in merger)
    assert not any(n.startswith("model.visual") for n in frozen)
    for setting, grads in (("trainable", trainable), ("merger", merger)):
        assert grads.keys() == plain[setting].keys()
        for name, g in grads.items():
            if name.startswith("model.visual"):
                assert float(g.abs().max()) > 0, name
                assert torch.allclose(g, plain[setting][name], rtol=1e-12, atol=1e-14), (setting, name)
    language = [n for n in trainable if not n.startswith("model.visual")]
    assert language and all(n in merger and n in frozen for n in language)
    for name in language:
        assert torch.allclose(merger[name], trainable[name], rtol=1e-12, atol=1e-14), name
        assert torch.allclose(frozen[name], trainable[name], rtol=1e-12, atol=1e-14), name


def test_step0_reference_equals_actor(models):
    """With reference == actor: detached and attached paths give identical log-probs (KL 0, ratio 1)."""
    model, _ = models
    prompts, responses, lens = _batch()
    ref = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=False)
    ref_lp, _ = suffix_logprobs(model, ref, responses, group_size=N, temperature=T, banned_ids=BANNED)
    act = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=True)
    act_lp, _ = suffix_logprobs(model, act, responses, group_size=N, temperature=T, banned_ids=BANNED)
    assert torch.equal(ref_lp, act_lp.detach())


@pytest.mark.parametrize("layer_recompute", [True, False])
def test_gradient_checkpointing_changes_no_gradient(models, layer_recompute):
    """Activation checkpointing (as `model.gradient_checkpointing` enables it: layer recompute in the
    prefix and vision passes, torch's non-reentrant checkpoint in the suffix; or torch's everywhere)
    recomputes the layers in backward: every gradient, vision included, is the same as without it."""

    model = models[0]
    ckpt = copy.deepcopy(model)
    enable_checkpointing(ckpt, layer_recompute=layer_recompute)
    prompts, responses, lens = _batch()
    grads = []
    for m in (model, ckpt):
        m.zero_grad(set_to_none=True)
        m.requires_grad_(True)
        prefix = prefix_forward(m, prompts, temperature=T, banned_ids=BANNED, attached=True)
        got, _ = suffix_logprobs(m, prefix, responses, group_size=N, temperature=T, banned_ids=BANNED)
        _loss([got[b, : lens[b]] for b in range(len(lens))]).backward()
        grads.append(_grads(m))
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], rtol=1e-12, atol=1e-14), name


def _layer_activations(model, refs: list) -> list:
    """Forward hooks that keep a weak reference to each decoder layer's input and output hidden states
    (under checkpointing, what each layer saves for its recompute), for as long as they are registered."""

    def keep_input(module, args, kwargs):
        refs.append(weakref.ref(args[0] if args else kwargs["hidden_states"]))

    def keep_output(module, args, out):
        refs.append(weakref.ref(out[0] if isinstance(out, tuple) else out))

    layers = model.model.language_model.layers
    return [layer.register_forward_pre_hook(keep_input, with_kwargs=True) for layer in layers] + [
        layer.register_forward_hook(keep_output) for layer in layers
    ]


@pytest.mark.parametrize("checkpointing", ["off", "recompute", "torch"])
@pytest.mark.parametrize("ending", ["dropped", "suffix-dropped", "raised", "retained-backward"])
def test_attached_passes_free_their_tensors_however_they_end(models, checkpointing, ending):
    """An attached prefix is freed once dropped, however its pass ended: dropped without a backward pass
    (a step that raised after the pass and before the actor's backward), with a suffix scored against
    it, raised inside the pass (the final norm fails), or after a backward that kept the graph
    (``retain_graph``). Under activation checkpointing the layers' recompute closures keep the prefix
    plan alive through the autograd graph: a boundary tensor left in the plan, or recorded there by a
    recompute, made a cycle Python's collector cannot see into, and the pass's memory was never freed
    (torch's checkpoint; layer recompute keeps no reference to the plan)."""
    m = copy.deepcopy(models[0]).requires_grad_(True)
    if checkpointing != "off":
        enable_checkpointing(m, layer_recompute=checkpointing == "recompute")
    assert m.model.language_model.layers[0].gradient_checkpointing == (checkpointing != "off")
    prompts, responses, _ = _batch()
    refs: list = []
    hooks = _layer_activations(m, refs)
    if ending == "raised":
        m.model.language_model.norm.register_forward_hook(lambda *_: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            prefix_states(m, prompts, temperature=T, banned_ids=BANNED, attached=True)
    else:
        states = prefix_states(m, prompts, temperature=T, banned_ids=BANNED, attached=True)
        assert all(s.keys[0].grad_fn is not None for s in states)
        refs += [weakref.ref(t) for s in states for t in (*s.keys, *s.values, s.last_logprobs)]
        if ending == "suffix-dropped":
            prefix = merge_prefixes(states)
            lp, _ = suffix_logprobs(m, prefix, responses, group_size=N, temperature=T, banned_ids=BANNED)
            refs += [weakref.ref(t) for t in (*prefix.keys, lp)]
            del prefix, lp
        if ending == "retained-backward":
            sum(s.last_logprobs.sum() + sum(k.sum() for k in s.keys) for s in states).backward(
                retain_graph=True
            )
        del states
    for hook in hooks:
        hook.remove()
    assert len(refs) >= len(m.model.language_model.layers)
    gc.collect()
    assert sum(r() is not None for r in refs) == 0

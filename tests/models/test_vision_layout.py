"""The vision tower's index tensors made once on the host (``models.vision_layout``): the tower given them
computes what it computes deriving them itself (float64, values and gradients, both vision attention
backends), they are kept per grid, the boundary tensors they hand to the attention are read once over
several passes, and a transformers release without them falls back to the tower's own derivation. On
CUDA, a prefix and suffix forward never makes the host wait for the device."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from rollplex.models import vision_layout as layouts
from rollplex.models.forward import _vision_output, prefix_forward, prepare_model, suffix_logprobs
from rollplex.models.vision_layout import vision_layout
from tests.models.test_vision_attention import spy_batching
from tests.numerics.conftest import BANNED, tiny_config

GRIDS = [[(2, 12, 20)], [(1, 8, 8), (4, 16, 12)]]


def _tiny(vision_attention: str):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config()).double()
    prepare_model(model, vision_attention=vision_attention)
    return model


@pytest.mark.parametrize("vision_attention", ["batched", "per_chunk"])
@pytest.mark.parametrize("grids", GRIDS)
def test_the_tower_given_the_layout_computes_what_it_derives(vision_attention, grids):
    """Ragged edge windows and several videos in one call: the same output and gradients, bitwise."""
    model = _tiny(vision_attention)
    visual = model.model.visual
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(1).sum()), 3 * 2 * 14 * 14, dtype=torch.float64)
    layout = vision_layout(visual, grid_thw, pixels.device)
    assert layout is not None
    runs = []
    for kwargs in ({}, layout.kwargs()):
        px = pixels.clone().requires_grad_(True)
        out = visual(px, grid_thw=grid_thw, **kwargs).pooler_output
        runs.append((out, *torch.autograd.grad(out.square().sum(), (px, visual.blocks[0].attn.qkv.weight))))
    for derived, given in zip(*runs):
        assert torch.equal(derived, given)


def test_layouts_are_kept_per_grid(monkeypatch):
    """Equal grid values in another tensor find the kept layout; another grid gets its own; past
    ``_LAYOUT_SLOTS`` the least recently used goes."""
    visual = _tiny("batched").model.visual
    cpu = torch.device("cpu")
    first = vision_layout(visual, torch.tensor([(2, 12, 20)]), cpu)
    assert vision_layout(visual, torch.tensor([(2, 12, 20)]), cpu) is first
    other = vision_layout(visual, torch.tensor([(1, 8, 8)]), cpu)
    assert other is not first and other.grid.tolist() == [[1, 8, 8]]
    monkeypatch.setattr(layouts, "_LAYOUT_SLOTS", 2)
    vision_layout(visual, torch.tensor([(2, 12, 20)]), cpu)  # first is now the most recently used
    vision_layout(visual, torch.tensor([(4, 16, 12)]), cpu)  # so other goes
    assert vision_layout(visual, torch.tensor([(2, 12, 20)]), cpu) is first
    assert vision_layout(visual, torch.tensor([(1, 8, 8)]), cpu) is not other


def test_the_key_holds_the_tower_settings_and_the_device(monkeypatch):
    """Another window size or attention backend, or another device, gets its own layout."""
    visual = _tiny("batched").model.visual
    grid, cpu = torch.tensor([(2, 12, 20)]), torch.device("cpu")
    first = vision_layout(visual, grid, cpu)
    assert vision_layout(visual, grid, torch.device("meta")) is not first
    monkeypatch.setattr(visual, "window_size", visual.window_size * 2)
    wider = vision_layout(visual, grid, cpu)
    assert wider is not first and not torch.equal(wider.cu_window_seqlens, first.cu_window_seqlens)
    monkeypatch.setattr(visual, "window_size", visual.window_size // 2)
    monkeypatch.setattr(visual.config, "_attn_implementation", "sdpa")
    per_chunk = vision_layout(visual, grid, cpu)
    assert per_chunk is not first and per_chunk.max_seqlen is None and first.max_seqlen is not None


def test_the_first_pass_reads_no_boundaries_back(monkeypatch):
    """The batched attention's chunk plans are made from the boundaries' host values with the layout,
    so even the first forward over a grid finds them kept (``chunk_plan`` reads no boundary tensor)."""
    from rollplex.models import attention

    model = _tiny("batched")
    grid_thw = torch.tensor([(2, 12, 20)])
    pixels = torch.randn(int(grid_thw.prod()), 3 * 2 * 14 * 14, dtype=torch.float64)
    layout = vision_layout(model.model.visual, grid_thw, pixels.device)
    kept = {ref() for ref, _, _ in attention._PLANS.values()}
    assert any(t is layout.cu_seqlens for t in kept) and any(t is layout.cu_window_seqlens for t in kept)
    made = []
    make = attention._make_plan
    monkeypatch.setattr(attention, "_make_plan", lambda *args: made.append(args) or make(*args))
    out = _vision_output(model, pixels, grid_thw)
    assert made == []  # chunk_plan found both plans: it read no boundaries and made none
    assert torch.equal(out, model.model.visual(pixels, grid_thw=grid_thw).pooler_output)


def test_a_layout_made_in_inference_mode_serves_training():
    """Made under ``torch.inference_mode`` (a caller's evaluation), the kept tensors are ordinary ones: a
    later pass over the grid with gradients can save them for backward."""
    model = _tiny("batched")
    grid_thw = torch.tensor([(2, 12, 20)])
    pixels = torch.randn(int(grid_thw.prod()), 3 * 2 * 14 * 14, dtype=torch.float64)
    with torch.inference_mode():
        _vision_output(model, pixels, grid_thw)
    out = _vision_output(model, pixels.requires_grad_(True), grid_thw)
    out.square().sum().backward()
    assert pixels.grad is not None


def test_a_plan_remade_in_inference_mode_serves_training():
    """A layout whose chunk plans are gone (evicted) gets them again from ``chunk_plan`` in the next
    pass; made there under inference mode, they still serve a later pass with gradients."""
    from rollplex.models import attention

    model = _tiny("batched")
    grid_thw = torch.tensor([(2, 12, 20)])
    pixels = torch.randn(int(grid_thw.prod()), 3 * 2 * 14 * 14, dtype=torch.float64)
    _vision_output(model, pixels, grid_thw)
    attention._PLANS.clear()
    with torch.inference_mode():
        _vision_output(model, pixels, grid_thw)
    _vision_output(model, pixels.requires_grad_(True), grid_thw).square().sum().backward()
    assert pixels.grad is not None


def _plans_kept(layout) -> bool:
    from rollplex.models import attention

    kept = {id(ref()) for ref, _, _ in attention._PLANS.values()}
    return id(layout.cu_seqlens) in kept and id(layout.cu_window_seqlens) in kept


def test_kept_layouts_keep_their_plans(monkeypatch):
    """Every kept grid keeps both chunk plans; a layout used more recently than another outlives it, plans
    included, when a new grid comes (layouts and plans both go least recently used first)."""
    from rollplex.models import attention

    monkeypatch.setattr(layouts, "_LAYOUT_SLOTS", 2)
    monkeypatch.setattr(attention, "_PLAN_SLOTS", 4)
    model = _tiny("batched")
    grids = [torch.tensor([g]) for g in [(2, 12, 20), (1, 8, 8), (4, 16, 12)]]
    pixels = [torch.randn(int(g.prod()), 3 * 2 * 14 * 14, dtype=torch.float64) for g in grids]
    a, b = (vision_layout(model.model.visual, g, torch.device("cpu")) for g in grids[:2])
    assert _plans_kept(a) and _plans_kept(b)
    _vision_output(model, pixels[0], grids[0])  # a is used: b is now the least recently used
    c = vision_layout(model.model.visual, grids[2], torch.device("cpu"))
    assert _plans_kept(a) and _plans_kept(c) and not _plans_kept(b)
    made = []
    make = attention._make_plan
    monkeypatch.setattr(attention, "_make_plan", lambda *args: made.append(args) or make(*args))
    _vision_output(model, pixels[0], grids[0])
    assert made == []


def test_all_kept_grids_keep_their_plans():
    """At the default slots, many kept grids (here 40) keep both plans each."""
    visual = _tiny("batched").model.visual
    kept = [vision_layout(visual, torch.tensor([(2, 8, 8 + 2 * i)]), torch.device("cpu")) for i in range(40)]
    assert all(_plans_kept(layout) for layout in kept)


def test_a_device_without_an_index_is_keyed_as_the_current_one(monkeypatch):
    from rollplex.models.transfer import stream_key

    class Stream:
        stream_id = 7

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: Stream())
    assert stream_key(torch.device("cuda")) == stream_key(torch.device("cuda", 0)) == ("cuda", 0, 7)


def test_a_placeholder_count_unlike_the_features_is_refused():
    """B06: the prompt's placeholders of a vision token must match the tower's features one to one."""
    from rollplex.models.forward import _placeholders

    ids = torch.tensor([5, 7, 7, 7, 6])
    assert _placeholders(ids, 7, 3, torch.device("cpu")).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="3 placeholders of id 7 but 4 features"):
        _placeholders(ids, 7, 4, torch.device("cpu"))


def test_passes_over_one_grid_read_its_boundaries_once(monkeypatch):
    """Rollout, reference and actor each run the tower on a group's video: the boundary tensors of the
    kept layout are the same objects every pass, so their plans are made once, from their host values
    (two tensors: windows and whole frames); without the layout every forward read two new ones."""
    model = _tiny("batched")
    reference = copy.deepcopy(model)
    grid_thw = torch.tensor([(2, 12, 20)])
    pixels = torch.randn(int(grid_thw.prod()), 3 * 2 * 14 * 14, dtype=torch.float64)
    counts = spy_batching(monkeypatch)
    outs = [_vision_output(m, pixels, grid_thw) for m in (model, reference, model)]
    assert counts["reads"] == 2
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(outs[0], model.model.visual(pixels, grid_thw=grid_thw).pooler_output)


def test_without_transformers_vision_utils_the_tower_derives_them(monkeypatch):
    model = _tiny("batched")
    grid_thw = torch.tensor([(2, 12, 20)])
    pixels = torch.randn(int(grid_thw.prod()), 3 * 2 * 14 * 14, dtype=torch.float64)
    want = _vision_output(model, pixels, grid_thw)
    monkeypatch.setitem(sys.modules, "transformers.vision_utils", None)  # import fails
    assert vision_layout(model.model.visual, grid_thw, pixels.device) is None
    assert torch.equal(_vision_output(model, pixels, grid_thw), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefix_and_suffix_forwards_never_wait_for_the_device():
    """Prompts as the data loader makes them (ids, positions and grids on the host): after a first pass
    (which makes the layouts and chunk plans), the rollout/reference prefix, the actor's attached prefix
    and the suffix scoring run with CUDA's synchronisation check set to fail on any wait."""
    from tests.numerics.test_gpu_paths import _prompts

    model = _tiny("batched").float().cuda()
    prompts = _prompts("cuda", torch.float32)
    banned = BANNED.cuda()
    responses = torch.randint(3, 150, (len(prompts) * 2, 6), device="cuda")

    def passes():
        for attached in (False, True):
            with torch.enable_grad() if attached else torch.no_grad():
                prefix = prefix_forward(model, prompts, temperature=1.0, banned_ids=banned, attached=attached)
                suffix_logprobs(model, prefix, responses, group_size=2, temperature=1.0, banned_ids=banned)

    passes()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        passes()
    finally:
        torch.cuda.set_sync_debug_mode("default")

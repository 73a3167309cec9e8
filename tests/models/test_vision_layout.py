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


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(layouts, "_LAYOUTS", type(layouts._LAYOUTS)())


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


def test_passes_over_one_grid_read_its_boundaries_once(monkeypatch):
    """Rollout, reference and actor each run the tower on a group's video: the boundary tensors of the
    kept layout are the same objects every pass, so ``chunk_plan`` reads them in the first pass only
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

"""The layout table: every parameter of every preset matches exactly one entry (meta device, no
weights), every entry is used, per-rank shapes, and shards that put the full tensor back together."""

from __future__ import annotations

import pytest
import torch

from rollplex.models.presets import PRESETS, meta_model
from rollplex.parallel.layout import LAYOUT, Placement, entry, matches, shard_index, shard_shape, shard_shapes


@pytest.fixture(scope="module")
def preset_shapes():
    return {name: [(n, tuple(p.shape)) for n, p in meta_model(name).named_parameters()] for name in PRESETS}


def test_every_parameter_of_every_preset_matches_exactly_one_entry(preset_shapes):
    used = set()
    for preset, shapes in preset_shapes.items():
        for name, _ in shapes:
            found = matches(name)
            assert len(found) == 1, (preset, name, found)
            used.add(found[0])
    assert used == set(LAYOUT), set(LAYOUT) - used


def test_unknown_parameter_is_refused():
    with pytest.raises(ValueError, match=r"'model\.extra\.weight' matches 0 tensor-parallel layout entries"):
        entry("model.extra.weight")


def test_placements_of_the_blocks():
    layer = "model.language_model.layers.7."
    expect = {
        "self_attn.q_proj.weight": Placement.COLUMN,
        "self_attn.k_proj.bias": Placement.COLUMN,
        "self_attn.o_proj.weight": Placement.ROW,
        "mlp.gate_proj.weight": Placement.COLUMN,
        "mlp.down_proj.weight": Placement.ROW,
        "input_layernorm.weight": Placement.REPLICATED,
    }
    for suffix, placement in expect.items():
        assert entry(layer + suffix).train is placement and entry(layer + suffix).rollout is placement
    assert entry("lm_head.weight").train is Placement.VOCAB
    assert entry("model.visual.blocks.0.mlp.down_proj.weight").train is Placement.REPLICATED
    assert entry(layer + "self_attn.o_proj.weight").storage == "transposed"
    assert entry(layer + "self_attn.v_proj.weight").buffer == "qkv"


def test_per_rank_shapes_of_the_32b_model(preset_shapes):
    shapes = shard_shapes(preset_shapes["qwen2.5-vl-32b"], 8, 3)
    layer = "model.language_model.layers.0."
    assert shapes[layer + "self_attn.q_proj.weight"] == (640, 5120)  # 5 of 40 heads
    assert shapes[layer + "self_attn.k_proj.weight"] == (128, 5120)  # 1 of 8 key/value heads
    assert shapes[layer + "self_attn.k_proj.bias"] == (128,)
    assert shapes[layer + "self_attn.o_proj.weight"] == (5120, 640)
    assert shapes[layer + "mlp.up_proj.weight"] == (3456, 5120)
    assert shapes[layer + "mlp.down_proj.weight"] == (5120, 3456)
    assert shapes["model.language_model.embed_tokens.weight"] == (19008, 5120)
    assert shapes["lm_head.weight"] == (19008, 5120)
    assert shapes["model.visual.blocks.0.mlp.gate_proj.weight"] == (3456, 1280)  # replicated
    with pytest.raises(ValueError, match=r"dimension 0 of size 1024 is not divisible by the TP degree 3"):
        shard_shape(layer + "self_attn.k_proj.weight", (1024, 5120), 3, 0)


def test_shards_put_every_tensor_back_together():
    model = meta_model("tiny-tp")
    for name, p in model.named_parameters():
        full = torch.arange(p.numel(), dtype=torch.float64).view(p.shape)
        for tp in (1, 2, 4):
            pieces = [full[shard_index(name, tuple(p.shape), tp, r)] for r in range(tp)]
            for r, piece in enumerate(pieces):
                assert tuple(piece.shape) == shard_shape(name, tuple(p.shape), tp, r)
            dim = entry(name).train.dim
            if dim is None:
                assert all(torch.equal(piece, full) for piece in pieces)
            else:
                assert torch.equal(torch.cat(pieces, dim=dim), full), (name, tp)

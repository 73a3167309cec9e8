"""3D M-RoPE positions against hand-computed layouts (docs/qwen2.5-vl.md, "3D positions"; field cases B01,
B04, B06)."""

from __future__ import annotations

import pytest
import torch

from rollplex.models.positions import VisionTokens, response_positions, rope_positions

IMG, VID = 151655, 151656
TOKENS = VisionTokens(image_token_id=IMG, video_token_id=VID, spatial_merge_size=2, tokens_per_second=2.0)


def _ids(*runs: tuple[str, int]) -> torch.Tensor:
    token = {"text": 7, "image": IMG, "video": VID}
    return torch.tensor([token[kind] for kind, n in runs for _ in range(n)])


def test_layout_a():
    """text 5, image grid (1,4,6) -> 6 tokens, text 4: image t=5; h=5,5,5,6,6,6; w=5,6,7,5,6,7;
    trailing text 8..11; rope_delta -3; first response position 12."""
    ids = _ids(("text", 5), ("image", 6), ("text", 4))
    pos, nxt = rope_positions(ids, TOKENS, image_grid_thw=torch.tensor([[1, 4, 6]]))
    assert pos[:, :5].tolist() == [list(range(5))] * 3
    assert pos[0, 5:11].tolist() == [5] * 6
    assert pos[1, 5:11].tolist() == [5, 5, 5, 6, 6, 6]
    assert pos[2, 5:11].tolist() == [5, 6, 7, 5, 6, 7]
    assert pos[:, 11:].tolist() == [[8, 9, 10, 11]] * 3
    assert nxt == 12 and nxt - len(ids) == -3


def test_layout_b_and_no_state_between_calls():
    """B01: Layout A then Layout B; B's first response position is 9 (not 21 - 3 = 18)."""
    rope_positions(
        _ids(("text", 5), ("image", 6), ("text", 4)), TOKENS, image_grid_thw=torch.tensor([[1, 4, 6]])
    )
    ids = _ids(("text", 3), ("image", 16), ("text", 2))
    pos, nxt = rope_positions(ids, TOKENS, image_grid_thw=torch.tensor([[1, 8, 8]]))
    assert pos[0, 3:19].tolist() == [3] * 16
    assert pos[1, 3:19].tolist() == [3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6]
    assert pos[2, 3:19].tolist() == [3, 4, 5, 6] * 4
    assert pos[:, 19:].tolist() == [[7, 8]] * 3
    assert nxt == 9 and nxt - len(ids) == -12
    resp = response_positions(torch.tensor([nxt]), 4, group_size=2)
    assert resp.shape == (3, 2, 4) and resp[:, 0].tolist() == [[9, 10, 11, 12]] * 3


@pytest.mark.parametrize(
    ("spg", "temporal"),
    [(1.0, [0, 2, 4, 6]), (0.5, [0, 1, 2, 3]), (2 / 1.28, [0, 3, 6, 9]), (2.0, [0, 4, 8, 12])],
)
def test_video_temporal_axis_follows_second_per_grid(spg, temporal):
    """B04: temporal index k sits at s + floor(k · second_per_grid · tokens_per_second); 2/1.28 s per
    grid (a 600 s clip capped at 768 frames) gives floor(k · 3.125)."""
    ids = _ids(("text", 2), ("video", 4 * 4), ("text", 1))
    pos, nxt = rope_positions(
        ids, TOKENS, video_grid_thw=torch.tensor([[4, 4, 4]]), second_per_grid_ts=torch.tensor([spg])
    )
    assert pos[0, 2:18].tolist() == [2 + t for t in temporal for _ in range(4)]
    assert pos[1, 2:18].tolist() == [2, 2, 3, 3] * 4
    assert pos[2, 2:18].tolist() == [2, 3, 2, 3] * 4
    last = 2 + max(temporal[-1], 1)
    assert pos[:, 18].tolist() == [last + 1] * 3 and nxt == last + 2


def test_video_then_image_positions_continue_from_the_largest():
    ids = _ids(("text", 1), ("video", 8), ("text", 1), ("image", 4), ("text", 1))
    pos, nxt = rope_positions(
        ids,
        TOKENS,
        image_grid_thw=torch.tensor([[1, 4, 4]]),
        video_grid_thw=torch.tensor([[4, 2, 4]]),
        second_per_grid_ts=torch.tensor([1.0]),
    )
    # video at s=1: temporal 1,3,5,7 (each over 1x2 merged tokens); max 7 -> text at 8, image at 9
    assert pos[0, 1:9].tolist() == [1, 1, 3, 3, 5, 5, 7, 7]
    assert pos[:, 9].tolist() == [8, 8, 8]
    assert pos[1, 10:14].tolist() == [9, 9, 10, 10] and pos[2, 10:14].tolist() == [9, 10, 9, 10]
    assert pos[:, 14].tolist() == [11, 11, 11] and nxt == 12


def test_cut_vision_span_is_rejected():
    """B06: a span whose placeholder count differs from its grid (a truncated prompt) is an error."""
    ids = _ids(("text", 4), ("image", 10), ("text", 6))
    with pytest.raises(ValueError, match="needs 16"):
        rope_positions(ids, TOKENS, image_grid_thw=torch.tensor([[1, 8, 8]]))
    with pytest.raises(ValueError, match="grids"):
        rope_positions(_ids(("text", 4)), TOKENS, image_grid_thw=torch.tensor([[1, 8, 8]]))


def test_text_only_prompt():
    pos, nxt = rope_positions(_ids(("text", 12)), TOKENS)
    assert pos.tolist() == [list(range(12))] * 3 and nxt == 12


@pytest.mark.parametrize(
    "layout",
    [
        [("text", 5), ("image", (1, 4, 6)), ("text", 4)],  # layout A
        [("text", 3), ("image", (1, 8, 8)), ("text", 2)],  # layout B
        [("image", (1, 4, 6)), ("text", 2), ("image", (1, 6, 4)), ("text", 1)],  # starts with an image
    ],
)
def test_image_positions_equal_transformers_get_rope_index(layout):
    """An independent oracle for image-only prompts: transformers' own ``get_rope_index``, for images of
    one temporal patch, which is what the image processor makes. (For more temporal patches, and after a
    video, releases differ from the reference rule (docs/qwen2.5-vl.md, "3D positions"), 4.57's, which the
    hand-computed tests above pin.) The signature is that of the supported releases (>= 5.17), which take the
    token types."""
    from rollplex.models.presets import meta_model

    model = meta_model("tiny")
    tokens = VisionTokens.from_config(model.config)
    merge = tokens.spatial_merge_size
    ids, grids = [], []
    for kind, size in layout:
        if kind == "text":
            ids += [7] * size
        else:
            t, h, w = size
            ids += [tokens.image_token_id] * (t * h * w // merge**2)
            grids.append(size)
    ids, grid = torch.tensor(ids), torch.tensor(grids)
    mine, next_position = rope_positions(ids, tokens, image_grid_thw=grid)
    types = (ids == tokens.image_token_id).int()  # 0 text, 1 image
    theirs, delta = model.model.get_rope_index(ids[None], types[None], image_grid_thw=grid)
    assert torch.equal(mine, theirs[:, 0]) and next_position - len(ids) == int(delta.flatten()[0])

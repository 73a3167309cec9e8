"""3D (M-RoPE) position ids of a Qwen2.5-VL prompt, computed by rollplex with the reference rule.

Reference rule (transformers 4.57 ``get_rope_index`` and vLLM ``get_mrope_input_positions``;
docs/qwen2.5-vl.md, "3D positions"): a text run of length L starting at s takes s..s+L-1 on all three rows.
A vision run with grid (t, h, w) patches has t·h·w / m² merged tokens (m = spatial merge size) in
t-major, then row, then column order; starting at s it takes

    temporal = s + floor(k · second_per_grid_t · tokens_per_second)   (k = temporal index; images: s)
    height   = s + row,   width = s + column.

The next run starts at (largest position used so far, over all rows) + 1, and the first response token
sits at that same "next position" on all three rows. rollplex always passes these positions explicitly,
so no transformers version's own rule (which differs after videos in 5.x) and no cached offset state
(field case B01) is ever used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionTokens:
    """Token ids and geometry the position rule needs.

    Example:
        VisionTokens(image_token_id=151655, video_token_id=151656, spatial_merge_size=2, tokens_per_second=2.0)
    """

    image_token_id: int
    video_token_id: int
    spatial_merge_size: int
    tokens_per_second: float

    @classmethod
    def from_config(cls, config) -> VisionTokens:
        """Read the ids from a ``Qwen2_5_VLConfig``."""
        vision = config.vision_config
        return cls(
            image_token_id=int(config.image_token_id),
            video_token_id=int(config.video_token_id),
            spatial_merge_size=int(vision.spatial_merge_size),
            tokens_per_second=float(vision.tokens_per_second),
        )


def _runs(input_ids: list[int], token_ids: tuple[int, int]) -> list[tuple[int, int, int]]:
    """Maximal runs of vision placeholder ids as (start, length, token id)."""
    runs, i, n = [], 0, len(input_ids)
    while i < n:
        if input_ids[i] in token_ids:
            j = i
            while j < n and input_ids[j] == input_ids[i]:
                j += 1
            runs.append((i, j - i, input_ids[i]))
            i = j
        else:
            i += 1
    return runs


def _vision_block(grid: tuple[int, int, int], merge: int, temporal_step: float, start: int) -> torch.Tensor:
    """Positions int64 [3, t·h'·w'] of one vision span starting at ``start``."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    # The small epsilon keeps exact products (e.g. 3 · 0.5 · 2) from flooring one step low.
    temporal = [start + math.floor(k * temporal_step + 1e-9) for k in range(t)]
    t_row = torch.tensor(temporal, dtype=torch.long).repeat_interleave(h * w)
    h_row = (torch.arange(h).repeat_interleave(w)).repeat(t) + start
    w_row = torch.arange(w).repeat(t * h) + start
    return torch.stack([t_row, h_row, w_row])


def rope_positions(
    input_ids: torch.Tensor,
    tokens: VisionTokens,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """3D positions of one prompt and its first response position.

    Args:
        input_ids: int64 [P], placeholders already expanded (one id per merged vision token).
        tokens: placeholder ids and vision geometry.
        image_grid_thw: int64 [n_images, 3] patch grids, in order of appearance; None if no image.
        video_grid_thw: int64 [n_videos, 3]; second_per_grid_ts: float [n_videos] seconds per temporal grid.

    Returns:
        (positions int64 [3, P], next_position) where next_position = max position + 1.

    Raises:
        ValueError: a placeholder run whose length is not t·h·w/m² of its grid, or a count of runs that
            differs from the number of grids (a cut or extra vision span, field cases B05/B06).
    """
    ids = input_ids.tolist()
    grids = {
        tokens.image_token_id: _grid_list(image_grid_thw),
        tokens.video_token_id: _grid_list(video_grid_thw),
    }
    steps = {tokens.image_token_id: [0.0] * len(grids[tokens.image_token_id])}
    spg = [] if second_per_grid_ts is None else [float(s) for s in second_per_grid_ts.tolist()]
    steps[tokens.video_token_id] = [s * tokens.tokens_per_second for s in spg]
    if len(steps[tokens.video_token_id]) != len(grids[tokens.video_token_id]):
        raise ValueError(
            f"second_per_grid_ts has {len(spg)} entries but video_grid_thw has "
            f"{len(grids[tokens.video_token_id])} videos"
        )
    used = {tokens.image_token_id: 0, tokens.video_token_id: 0}
    pieces, cursor, next_pos = [], 0, 0
    merge2 = tokens.spatial_merge_size**2
    for start, length, token in _runs(ids, (tokens.image_token_id, tokens.video_token_id)):
        pieces.append(_text_block(start - cursor, next_pos))
        next_pos += start - cursor
        index = used[token]
        if index >= len(grids[token]):
            raise ValueError(
                f"prompt has more vision spans of token {token} than grids ({len(grids[token])})"
            )
        grid = grids[token][index]
        if length != grid[0] * grid[1] * grid[2] // merge2:
            raise ValueError(
                f"vision span at token {start} has {length} placeholders but grid {grid} needs "
                f"{grid[0] * grid[1] * grid[2] // merge2}"
            )
        block = _vision_block(grid, tokens.spatial_merge_size, steps[token][index], next_pos)
        pieces.append(block)
        next_pos = int(block.max()) + 1
        used[token] += 1
        cursor = start + length
    for token, count in used.items():
        if count != len(grids[token]):
            raise ValueError(
                f"{len(grids[token])} grids given for token {token} but {count} spans in the prompt"
            )
    pieces.append(_text_block(len(ids) - cursor, next_pos))
    next_pos += len(ids) - cursor
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 if positions.numel() else 0


def _text_block(length: int, start: int) -> torch.Tensor:
    return (torch.arange(length, dtype=torch.long) + start).expand(3, length)


def _grid_list(grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    if grid_thw is None:
        return []
    return [tuple(int(x) for x in row) for row in grid_thw.tolist()]


def response_positions(next_position: torch.Tensor, length: int, group_size: int) -> torch.Tensor:
    """Positions int64 [3, G·N, length] of response tokens: next_position[g] + j on all three rows.

    Args:
        next_position: int64 [G], first response position of each group.
        length: number of response positions.
        group_size: N; rows are grouped as g·N + n.
    """
    base = next_position.repeat_interleave(group_size)[:, None] + torch.arange(
        length, device=next_position.device
    )
    return base.unsqueeze(0).expand(3, -1, -1)

"""The vision tower's per-grid index tensors, made once on the host and handed to transformers.

Given ``grid_thw`` alone, transformers' Qwen2.5-VL vision forward derives its rotary positions, its
frame and window boundaries, their longest chunks and the window token order, and reads ``grid_thw``
and those boundaries back to the host about a dozen times to do it (``.tolist()``, ``.item()``, and
indexing with host index tensors). Each read makes the host wait until the device has drained its
queue, and the device then idles while the host issues the next kernels; a step runs the tower once per
group and role. The forward also accepts all of them precomputed, as keyword arguments
(``position_ids``, ``cu_seqlens``, ``max_seqlen``, ``window_index``, ``cu_window_seqlens``,
``max_window_seqlen``). ``vision_layout`` computes them with transformers' own functions
(``transformers.vision_utils``) on a host copy of the grid, copies the tensors to the device once, and
keeps them per grid: the device queue is never drained for them, and the boundary tensors handed to the
attention are the same objects in every pass, so ``models.attention.chunk_plan`` reads them once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionLayout:
    """Index tensors of one ``grid_thw`` on one device: ``grid`` int64 [n, 3]; ``position_ids`` int64
    [tokens, 2] (rows of patches, window-major after the forward's permutation); ``cu_seqlens`` and
    ``cu_window_seqlens`` int32 frame and window boundaries; ``window_index`` int64 [tokens / 4], the
    merged tokens in window order; ``max_seqlen`` / ``max_window_seqlen`` the longest chunk in tokens,
    or None where the tower's attention backend does not take them."""

    grid: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int | None
    window_index: torch.Tensor
    cu_window_seqlens: torch.Tensor
    max_window_seqlen: int | None

    def kwargs(self) -> dict:
        """The keyword arguments of the vision forward (a new dict: the forward pops them)."""
        return {
            "position_ids": self.position_ids,
            "cu_seqlens": self.cu_seqlens,
            "max_seqlen": self.max_seqlen,
            "window_index": self.window_index,
            "cu_window_seqlens": self.cu_window_seqlens,
            "max_window_seqlen": self.max_window_seqlen,
        }


_LAYOUTS: OrderedDict[tuple, VisionLayout] = OrderedDict()
_LAYOUT_SLOTS = 64  # grids kept at most (newest used last), over all devices and streams
_LOCK = threading.Lock()  # the rollplex schedule runs vision towers on two threads


def vision_layout(visual, grid_thw: torch.Tensor, device: torch.device) -> VisionLayout | None:
    """The ``VisionLayout`` of ``grid_thw`` (int [n, 3], on any device) for the vision tower ``visual``
    on ``device``, made once per grid, tower settings, device and stream, or None where this
    transformers release has no ``transformers.vision_utils`` (the forward then derives them itself).

    A grid on the host costs no wait for the device; a grid on the device is read back once per call.
    The tensors were copied on the stream that made them, so the key includes it, as chunk plans do.
    """
    try:
        import transformers.vision_utils as vu
        from transformers.utils.generic import get_max_seqlen
    except ImportError:
        return None
    host = grid_thw.cpu() if grid_thw.device.type != "cpu" else grid_thw
    config = visual.config
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    settings = (visual.spatial_merge_size, visual.window_size, visual.patch_size, config._attn_implementation)
    key = (tuple(map(tuple, host.tolist())), settings, device.type, device.index, stream)
    with _LOCK:
        if key in _LAYOUTS:
            _LAYOUTS.move_to_end(key)
            return _LAYOUTS[key]
    position_ids = vu.get_vision_position_ids(host, visual.spatial_merge_size)
    cu_seqlens, max_seqlen = vu.get_vision_attention_seqlens(host, config)
    window_index, cu_window_seqlens = vu.get_vision_window_index(
        host,
        spatial_merge_size=visual.spatial_merge_size,
        window_size=visual.window_size,
        patch_size=visual.patch_size,
    )
    max_window_seqlen = get_max_seqlen(cu_window_seqlens, config, kwarg_name="max_window_seqlen")
    layout = VisionLayout(
        grid=to_device(host, device),
        position_ids=to_device(position_ids, device),
        cu_seqlens=to_device(cu_seqlens, device),
        max_seqlen=max_seqlen,
        window_index=to_device(window_index, device),
        cu_window_seqlens=to_device(cu_window_seqlens, device),
        max_window_seqlen=max_window_seqlen,
    )
    with _LOCK:
        _LAYOUTS[key] = layout
        while len(_LAYOUTS) > _LAYOUT_SLOTS:
            _LAYOUTS.popitem(last=False)
    return layout


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``. A host tensor goes to a GPU through pinned memory, without the host
    waiting for the device (a copy from pageable memory waits for the stream's earlier work first); the
    copy is ordered on the current stream, before any later use there."""
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)

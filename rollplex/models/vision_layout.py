"""The vision tower's per-grid index tensors, made once on the host and handed to transformers.

Given ``grid_thw`` alone, transformers' Qwen2.5-VL vision forward derives its rotary positions, its
frame and window boundaries, their longest chunks and the window token order, and reads ``grid_thw``
and those boundaries back to the host about a dozen times to do it (``.tolist()``, ``.item()``, and
indexing with host index tensors). Each read makes the host wait until the device has drained its
queue, and the device then idles while the host issues the next kernels; a step runs the tower once per
group and role. The forward also accepts all of them precomputed, as keyword arguments
(``position_ids``, ``cu_seqlens``, ``max_seqlen``, ``window_index``, ``cu_window_seqlens``,
``max_window_seqlen``), which it pops before calling its blocks (transformers 5.17 and later).

``vision_layout`` computes them with transformers' own functions (``transformers.vision_utils``) on a
host copy of the grid, copies the tensors to the device, and keeps them per grid. For the batched
vision attention it also makes the boundaries' chunk plans from their host values
(``models.attention.keep_plan``). So the boundary tensors handed to the attention are the same objects
in every pass over a grid, and no pass, the first included, reads anything back from the device when
the grid is on the host (as the data loader's prompts have it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from rollplex.models.attention import VISION_ATTENTION_NAME, keep_plan
from rollplex.models.transfer import stream_key, to_device


@dataclass(frozen=True, eq=False)
class VisionLayout:
    """Index tensors of one ``grid_thw`` (n images or videos) on one device.

    Fields:
        grid: [n, 3] (t, h, w) patches, the caller's integer dtype.
        position_ids: int64 [tokens, 2] (row, column) of each patch, merge blocks contiguous.
        cu_seqlens: int32 [frames + 1] boundaries of the full-attention chunks (one per temporal patch).
        max_seqlen: the longest of those chunks in tokens, or None where the tower's attention backend
            does not take it (transformers: flash-style backends only).
        window_index: int64 [tokens / spatial_merge_size²], the merged tokens in window order.
        cu_window_seqlens: int32 [windows + 1] boundaries of the windows (repeated ones dropped).
        max_window_seqlen: the longest window in tokens, or None as ``max_seqlen``.
    """

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
_LAYOUT_SLOTS = 64  # grids kept at most (least recently used first out), over all devices and streams
_LOCK = threading.Lock()  # the rollplex schedule runs vision towers on two threads


def vision_layout(visual, grid_thw: torch.Tensor, device: torch.device) -> VisionLayout | None:
    """The ``VisionLayout`` of ``grid_thw`` (int [n, 3], on any device) for the vision tower ``visual``
    on ``device``, made once per grid, tower settings (merge, window and patch sizes, attention backend),
    device and stream, or None where this transformers release has no ``transformers.vision_utils``
    (the forward then derives them itself).

    A grid on the host costs no wait for the device; a grid on the device is read back once per call.
    The tensors were copied on the stream that made them, so the key includes it, as chunk plans do.
    They are made outside inference mode and without autograd, so a layout first made under
    ``torch.inference_mode`` serves a later training pass too.

    Raises:
        RuntimeError: a grid whose height or width is not a multiple of the merge size (transformers).
    """
    try:
        import transformers.vision_utils as vu
        from transformers.utils.generic import get_max_seqlen
    except ImportError:
        return None
    host = grid_thw.cpu() if grid_thw.device.type != "cpu" else grid_thw
    config = visual.config
    settings = (visual.spatial_merge_size, visual.window_size, visual.patch_size, config._attn_implementation)
    key = (tuple(map(tuple, host.tolist())), settings, *stream_key(device))
    with _LOCK:
        if key in _LAYOUTS:
            _LAYOUTS.move_to_end(key)
            return _LAYOUTS[key]
        while len(_LAYOUTS) >= _LAYOUT_SLOTS:  # before the new plans are kept: the old ones can go
            _LAYOUTS.popitem(last=False)
    with torch.inference_mode(False), torch.no_grad():
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
            grid=to_device(host, device) if device.type != "cpu" else host.clone(),  # never the caller's
            position_ids=to_device(position_ids, device),
            cu_seqlens=to_device(cu_seqlens, device),
            max_seqlen=max_seqlen,
            window_index=to_device(window_index, device),
            cu_window_seqlens=to_device(cu_window_seqlens, device),
            max_window_seqlen=max_window_seqlen,
        )
        if config._attn_implementation == VISION_ATTENTION_NAME:  # models.attention.chunked_attention
            keep_plan(layout.cu_seqlens, cu_seqlens.tolist(), device)
            keep_plan(layout.cu_window_seqlens, cu_window_seqlens.tolist(), device)
    with _LOCK:
        _LAYOUTS[key] = layout
        while len(_LAYOUTS) > _LAYOUT_SLOTS:  # another thread kept one meanwhile
            _LAYOUTS.popitem(last=False)
    return layout

"""Host-to-device copies that do not make the host wait, and the stream key of per-stream caches."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``. A host tensor goes to a GPU through pinned memory, without the host
    waiting for the device (a copy from pageable memory first waits for the stream's earlier work); the
    copy is ordered on the current stream, before any later use there. A pageable tensor is copied into
    a pinned block of torch's caching host allocator, which keeps the block until the copy is done; an
    already pinned tensor is copied from as it is, so it must not be written before the copy has run.
    Any other tensor: ``tensor.to(device)``."""
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def stream_key(device: torch.device) -> tuple:
    """(device type, index, current stream id) for caches of device tensors per stream: a tensor copied on
    one stream is only ordered before later work on that stream (0 for the stream of a non-CUDA device)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return device.type, index, torch.cuda.current_stream(index).stream_id
    return device.type, device.index, 0

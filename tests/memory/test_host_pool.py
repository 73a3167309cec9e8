"""The pinned host pool: exact size, aligned non-overlapping views, reuse, and errors that name the
shortfall."""

from __future__ import annotations

import pytest
import torch

from rollplex.memory.host_pool import ALIGNMENT, PinnedHostPool, aligned, pool_bytes


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def test_the_pool_is_exactly_the_requested_size():
    nbytes = 2**20 + 3  # just over a power of two: a caching allocator would take 2 MiB
    pool = PinnedHostPool(nbytes, pin=False)
    assert pool.nbytes == nbytes
    assert pool.buffer.untyped_storage().nbytes() == nbytes
    assert pool.buffer.dtype == torch.uint8 and pool.buffer.device.type == "cpu"


def test_views_are_aligned_and_do_not_overlap():
    requests = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((), torch.float64), ((1000,), torch.int64)]
    pool = PinnedHostPool(pool_bytes(_numel(s) * d.itemsize for s, d in requests), pin=False)
    views = [pool.take(f"v{i}", s, d) for i, (s, d) in enumerate(requests)]
    base = pool.buffer.data_ptr()
    spans = sorted(_span(v) for v in views)
    for v, (shape, dtype) in zip(views, requests):
        assert v.shape == shape and v.dtype == dtype and v.is_contiguous()
        assert (v.data_ptr() - base) % ALIGNMENT == 0
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    assert all(base <= s and e <= base + pool.nbytes for s, e in spans)
    for i, v in enumerate(views):  # writing one view leaves the others as they were
        v.fill_(i + 1)
    assert all(bool((v == i + 1).all()) for i, v in enumerate(views))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_a_name_returns_the_same_bytes_every_step():
    pool = PinnedHostPool(4096, pin=False)
    first = pool.take("master", (16,), torch.float32)
    first.copy_(torch.arange(16.0))
    used = pool.used
    again = pool.take("master", (16,), torch.float32)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, torch.arange(16.0))
    assert pool.used == used  # nothing new reserved
    with pytest.raises(ValueError, match=r"'master' was taken as \(16,\) torch.float32"):
        pool.take("master", (8,), torch.float32)


def test_an_arena_is_reused_from_its_start_after_reset():
    pool = PinnedHostPool(pool_bytes([64, 4096]), pin=False)
    pool.take("small", (16,), torch.float32)
    arena = pool.arena("acts", 4096)
    a = arena.alloc((10,), torch.float32)
    b = arena.alloc((100,), torch.bfloat16)
    assert _span(a)[1] <= _span(b)[0] and (b.data_ptr() - a.data_ptr()) == aligned(40)
    assert arena.used == aligned(40) + aligned(200)
    arena.reset()
    c = arena.alloc((10,), torch.float32)
    assert c.data_ptr() == a.data_ptr() and arena.high_water == aligned(40) + aligned(200)
    assert pool.arena("acts", 4096).region.data_ptr() == arena.region.data_ptr()


def test_a_request_past_the_pool_names_the_shortfall():
    pool = PinnedHostPool(1000, pin=False)
    pool.take("a", (100,), torch.float32)  # 400 bytes, 512 with alignment
    with pytest.raises(
        ValueError, match=r"'b' needs 800 bytes but 488 of the pool's 1000 are free: 312 bytes short"
    ):
        pool.take("b", (200,), torch.float32)
    arena = PinnedHostPool(2048, pin=False).arena("acts", 2048)
    arena.alloc((300,), torch.float32)  # 1200 bytes, 1536 with alignment
    with pytest.raises(ValueError, match="600 bytes requested, 512 of 2048 free: 88 bytes short"):
        arena.alloc((300,), torch.bfloat16)


def test_pool_bytes_counts_each_view_aligned():
    assert aligned(1) == ALIGNMENT and aligned(ALIGNMENT) == ALIGNMENT and aligned(0) == 0
    assert pool_bytes([1, ALIGNMENT + 1, 0]) == 3 * ALIGNMENT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_registered_memory_is_pinned_and_copies_asynchronously():
    """cudaHostRegister page-locks the pool in place: its views report is_pinned(), a non-blocking copy
    from them returns before the device has run it, and the bytes arrive intact."""
    nbytes = 64 * 2**20 + 7
    with PinnedHostPool(nbytes) as pool:
        assert pool.pinned and pool.nbytes == nbytes
        host = pool.take("x", (16 * 2**20,), torch.float32)
        assert host.is_pinned()
        host.copy_(torch.arange(host.numel(), dtype=torch.float32))
        device = torch.empty_like(host, device="cuda")
        torch.cuda._sleep(100_000_000)  # keep the stream busy: the copy queues behind it
        device.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        assert not event.query()  # the host got here before the copy ran
        torch.cuda.synchronize()
        assert torch.equal(device.cpu(), host)

"""The chunked optimizer gives bitwise the update of plain torch.optim.AdamW over FP32 masters after
torch.nn.utils.clip_grad_norm_, for every chunk size and placement (device, host pool, mixed)."""

from __future__ import annotations

import copy

import pytest
import torch

from rollplex.memory.chunked_adamw import (
    ChunkedAdamW,
    chunk_layout,
    host_chunks_for,
    host_state_bytes,
    storage_flat,
)
from rollplex.memory.host_pool import PinnedHostPool
from rollplex.memory.transfers import Transfers

HYPER = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
SHAPES = [(5, 7), (5,), (11, 3), (), (13,)]  # 35 + 5 + 33 + 1 + 13 = 87 elements
TOTAL = 87


class MasterWeightAdamW:
    # The optimizer rollplex shipped before ChunkedAdamW, kept here as it was: its checkpoints' format.

    """AdamW over FP32 masters of ``params``.

    Args:
        params: trainable parameters (any floating dtype).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
    """

    def __init__(
        self, params: list[torch.nn.Parameter], *, lr: float, betas, eps: float, weight_decay: float
    ):
        self.params = list(params)
        self.shadow = any(p.dtype in (torch.bfloat16, torch.float16) for p in self.params)
        if self.shadow:
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        else:
            self.masters = self.params
        self.inner = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def clip_and_step(self, max_grad_norm: float) -> float:
        """Clip the global gradient norm to ``max_grad_norm`` (0 = no clipping), step, zero gradients.
        A gradient whose global norm is not finite (a NaN or inf in it, or a norm past float32's range)
        is dropped without a step: the weights and the AdamW state stay as they were, where stepping
        would write NaN into every weight (and every later checkpoint).

        Returns:
            The global L2 gradient norm before clipping (float, finite or inf/nan as computed; not
            finite means the step was skipped).
        """
        if self.shadow:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None  # one parameter at a time: never both full gradient copies at once
        norm = torch.nn.utils.clip_grad_norm_(
            self.masters, max_grad_norm if max_grad_norm > 0 else float("inf")
        )
        if not torch.isfinite(norm):
            self.zero_grad()
            return float(norm)
        self.inner.step()
        if self.shadow:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        self.zero_grad()
        return float(norm)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.shadow:
            for m in self.masters:
                m.grad = None

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        state = {"inner": self.inner.state_dict()}
        if self.shadow:
            state["masters"] = [m.detach().cpu() for m in self.masters]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        if self.shadow:
            with torch.no_grad():
                for m, saved in zip(self.masters, state["masters"]):
                    m.copy_(saved)


def _params(dtype, device="cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in SHAPES]


class Reference:
    """What the all-resident update computes: FP32 masters (bf16 parameters) or the parameters
    themselves (float32), torch.nn.utils.clip_grad_norm_, torch.optim.AdamW, masters copied back."""

    def __init__(self, params):
        self.params = params
        self.shadow = params[0].dtype == torch.bfloat16
        self.masters = [p.detach().float().clone() for p in params] if self.shadow else params
        self.inner = torch.optim.AdamW(self.masters, **HYPER)

    def step(self, grads, max_norm):
        for m, g in zip(self.masters, grads):
            m.grad = None if g is None else g.to(m.dtype)
        norm = torch.nn.utils.clip_grad_norm_(self.masters, max_norm if max_norm > 0 else float("inf"))
        if torch.isfinite(norm):
            self.inner.step()
            if self.shadow:
                with torch.no_grad():
                    for p, m in zip(self.params, self.masters):
                        p.copy_(m)
        for m in self.masters:
            m.grad = None
        return float(norm)

    def tensors(self):
        out = {}
        for i, m in enumerate(self.masters):
            out[(i, "master")] = m.detach()
            state = self.inner.state.get(m, {})
            for name in ("exp_avg", "exp_avg_sq"):
                if name in state:
                    out[(i, name)] = state[name]
        return out


def _grads(params, step, *, none=(), poison=None):
    g = torch.Generator().manual_seed(100 + step)
    grads = [
        None if i in none else (torch.randn(p.shape, generator=g) * 3).to(p.dtype)
        for i, p in enumerate(params)
    ]
    if poison is not None:
        grads[2].view(-1)[4] = poison
    return grads


def _chunked(params, chunk, placement, device="cpu"):
    layout = chunk_layout(params, chunk)
    host = {
        "device": frozenset(),
        "host": frozenset(c.index for c in layout),
        "mixed": frozenset(c.index for c in layout if c.index % 2 == 0),
    }[placement]
    pool = PinnedHostPool(host_state_bytes(layout, host)) if host else None
    return ChunkedAdamW(
        params, **HYPER, chunk_elements=chunk, host_chunks=host, pool=pool, transfers=Transfers(device)
    )


def _ours(opt):
    return {(i, name): t for i, name, t in opt.state_tensors()}


def _assert_same(opt, ref, params, ref_params):
    ours, theirs = _ours(opt), ref.tensors()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key].cpu(), theirs[key].cpu()), key
    for p, q in zip(params, ref_params):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())
    for i, m in enumerate(ref.masters):
        state = ref.inner.state.get(m)
        assert (opt.steps[i] is None) == (state is None)
        if state is not None:
            assert torch.equal(opt.steps[i], state["step"])


def _run(dtype, chunk, placement, max_norm, steps=3, device="cpu", schedule=None):
    params, ref_params = _params(dtype, device), _params(dtype, device)
    opt, ref = _chunked(params, chunk, placement, device), Reference(ref_params)
    ptrs = [p.data_ptr() for p in params]
    for step in range(steps):
        kwargs = (schedule or {}).get(step, {})
        for p, g in zip(params, _grads(params, step, **kwargs)):
            p.grad = None if g is None else g.to(device)
        norm = opt.clip_and_step(max_norm)
        assert all(p.grad is None for p in params)
        expected = ref.step(
            [None if p is None else p.to(device) for p in _grads(ref_params, step, **kwargs)], max_norm
        )
        assert norm == expected or (norm != norm and expected != expected)
        _assert_same(opt, ref, params, ref_params)
    assert [p.data_ptr() for p in params] == ptrs  # written in place: captured graphs stay valid
    return opt, params


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk", [1, 7, 35, TOTAL], ids=["1-element", "odd", "one-parameter", "whole-model"])
@pytest.mark.parametrize("placement", ["device", "host", "mixed"])
@pytest.mark.parametrize("max_norm", [1.0, 0.0], ids=["clipped", "unclipped"])
def test_bitwise_the_all_resident_update(dtype, chunk, placement, max_norm):
    _run(dtype, chunk, placement, max_norm)


def test_clipping_is_active_in_the_clipped_cases():
    """The gradients' norm is well above 1, so max_norm 1 really scales them (the test above would not
    notice a missing clip otherwise)."""
    norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in _grads(_params(torch.float32), 0)]))
    assert norm > 10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("placement", ["device", "host", "mixed"])
def test_parameters_without_gradient_are_skipped_as_torch_skips_them(dtype, placement):
    schedule = {0: {"none": (0,)}, 1: {"none": (0, 3)}, 2: {"none": (2,)}}
    opt, _ = _run(dtype, 7, placement, 1.0, steps=4, schedule=schedule)
    assert [float(s) for s in opt.steps] == [2.0, 4.0, 3.0, 3.0, 4.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("placement", ["device", "host", "mixed"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_gradient_that_is_not_finite_commits_nothing(dtype, placement, poison):
    params = _params(dtype)
    opt = _chunked(params, 7, placement)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.clip_and_step(1.0)
    before = (copy.deepcopy(_ours(opt)), [p.detach().clone() for p in params], copy.deepcopy(opt.steps))
    for p, g in zip(params, _grads(params, 1, poison=poison)):
        p.grad = g
    assert not torch.isfinite(torch.tensor(opt.clip_and_step(1.0)))
    after = _ours(opt)
    assert after.keys() == before[0].keys()
    assert all(torch.equal(before[0][k], after[k]) for k in after)
    assert all(torch.equal(a, p) for a, p in zip(before[1], params))
    assert all(torch.equal(a, b) for a, b in zip(before[2], opt.steps))
    assert all(p.grad is None for p in params)


def test_the_skipped_step_then_continues_as_the_reference():
    _run(torch.bfloat16, 7, "mixed", 1.0, steps=4, schedule={1: {"poison": float("nan")}})


def _continue_both(*runs, steps):
    """Step each (optimizer, parameters) pair on the same gradients; the norms agree."""
    for step in steps:
        norms = set()
        for opt, params in runs:
            for p, g in zip(params, _grads(params, step)):
                p.grad = g
            norms.add(opt.clip_and_step(1.0))
        assert len(norms) == 1


@pytest.mark.parametrize("chunks", [(7, 35), (TOTAL, 1)])
@pytest.mark.parametrize("placements", [("host", "device"), ("mixed", "host")])
def test_state_dict_round_trip_across_chunk_sizes_and_placements(chunks, placements):
    opt, params = _run(torch.bfloat16, chunks[0], placements[0], 1.0, steps=2)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = _chunked(twin, chunks[1], placements[1])
    loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
    _continue_both((opt, params), (loaded, twin), steps=(2, 3))
    a, b = _ours(opt), _ours(loaded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(p, q) for p, q in zip(params, twin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_master_weight_adamw_checkpoint_resumes(dtype):
    """A state dict saved by the optimizer rollplex shipped before (MasterWeightAdamW) loads, and training continues bitwise as the old
    optimizer continues."""
    old_params, new_params = _params(dtype), _params(dtype)
    old = MasterWeightAdamW(old_params, **HYPER)
    _continue_both((old, old_params), steps=(0, 1))
    with torch.no_grad():
        for p, q in zip(new_params, old_params):
            p.copy_(q)
    new = _chunked(new_params, 7, "mixed")
    new.load_state_dict(copy.deepcopy(old.state_dict()))
    _continue_both((old, old_params), (new, new_params), steps=(2, 3))
    assert all(torch.equal(p, q) for p, q in zip(old_params, new_params))
    masters = dict(enumerate(old.masters))
    for i, name, tensor in new.state_tensors():
        expected = masters[i] if name == "master" else old.inner.state[masters[i]][name]
        assert torch.equal(tensor, expected.detach())


def test_a_state_dict_of_another_model_is_refused():
    opt = _chunked(_params(torch.float32), 7, "device")
    state = opt.state_dict()
    state["inner"]["param_groups"][0]["params"] = [0, 1]
    with pytest.raises(ValueError, match="2 parameters, the model 5"):
        opt.load_state_dict(state)


def test_chunks_are_byte_balanced_and_split_large_parameters():
    params = _params(torch.bfloat16)
    layout = chunk_layout(params, 10)
    assert [c.numel for c in layout] == [10] * 8 + [7]
    pieces = [(p.param, p.start, p.stop) for c in layout for p in c.pieces]
    assert pieces[:5] == [(0, 0, 10), (0, 10, 20), (0, 20, 30), (0, 30, 35), (1, 0, 5)]
    covered = {}
    for c in layout:
        assert sum(p.numel for p in c.pieces) == c.numel and c.shadow and c.dtype == torch.float32
        for p in c.pieces:
            covered.setdefault(p.param, []).append((p.start, p.stop))
    for index, ranges in covered.items():  # every element of every parameter exactly once, in order
        flat = [i for a, b in ranges for i in range(a, b)]
        assert flat == list(range(params[index].numel()))
    assert host_chunks_for(layout, 1) == {0}
    assert host_chunks_for(layout, layout[0].nbytes + 1) == {0, 1}
    assert host_chunks_for(layout, 0) == frozenset()
    assert host_chunks_for(layout, 10**9) == {c.index for c in layout}


def test_a_new_chunk_starts_where_the_dtype_changes():
    params = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)]
    layout = chunk_layout(params, 100)
    assert [(c.numel, c.dtype, c.shadow) for c in layout] == [
        (3, torch.float32, True),
        (3, torch.float32, False),
        (2, torch.float32, True),
    ]


def test_resident_bytes_by_place():
    opt = _chunked(_params(torch.bfloat16), 10, "mixed")
    by_place = opt.resident_bytes()
    host = sum(c.numel for c in opt.layout if c.index in opt.host_chunks) * 4
    assert by_place["master"] == {"host": host, "device": TOTAL * 4 - host}
    assert by_place["adam"] == {"host": 2 * host, "device": 2 * (TOTAL * 4 - host)}
    assert opt.transfers.moved == {}
    opt.params[0].grad = torch.ones_like(opt.params[0])
    opt.clip_and_step(0.0)
    assert opt.transfers.moved["optimizer"] == {"h2d": 3 * host, "d2h": 3 * host}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("placement", ["host", "mixed", "device"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bitwise_the_all_resident_update_on_cuda_with_streams(placement, dtype):
    """On CUDA the host chunks stream through real load/offload streams from page-locked memory, and
    the update is still bitwise torch's foreach AdamW over FP32 masters."""
    opt, params = _run(dtype, 7, placement, 1.0, steps=4, device="cuda")
    if placement != "device":
        assert opt.transfers.load_stream is not None


def _slab_params(dtype) -> list[torch.nn.Parameter]:
    """SHAPES' parameters, the first stored transposed (a Case 2 weight: the transpose of a contiguous
    slab, parallel.weight_sharing)."""
    params = _params(dtype)
    slab = params[0].detach().t().contiguous()
    params[0] = torch.nn.Parameter(slab.t())
    assert not params[0].is_contiguous()
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [4, 16, 1000])
def test_owned_ranges_of_two_ranks_make_the_whole_update(dtype, chunk):
    """ZeRO-1: two optimizers, each over its owned ranges (parallel.data_parallel.owned_ranges) of its
    own copy of the parameters, one a transposed slab, clipped by the global norm given to both: the
    elements each owns equal the all-resident update bitwise, after 3 steps."""
    from rollplex.parallel.data_parallel import owned_ranges

    reference = Reference(_slab_params(dtype))
    ranks = []
    for rank in range(2):
        params = _slab_params(dtype)
        owned = [(o.index, o.start, o.stop) for o in owned_ranges(params, rank, 2)]
        box = {}
        opt = ChunkedAdamW(
            params, **HYPER, chunk_elements=chunk, owned=owned, grad_norm=lambda _, b=box: b["norm"]
        )
        ranks.append((params, owned, opt, box))
    for step in range(3):
        grads = _grads(reference.params, step)
        norm = torch.nn.utils.get_total_norm([g.float() for g in grads])
        want = reference.step([g.clone() for g in grads], 1.0)  # it clips float32 gradients in place
        for params, _, opt, box in ranks:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            box["norm"] = norm
            assert opt.clip_and_step(1.0) == want
    for params, owned, _, _ in ranks:
        for index, start, stop in owned:
            got, expected = (
                storage_flat(params[index].detach()),
                storage_flat(reference.params[index].detach()),
            )
            assert torch.equal(got[start:stop], expected[start:stop]), (index, start, stop)


def test_owned_state_saves_and_loads_only_with_the_same_ranges():
    from rollplex.parallel.data_parallel import owned_ranges

    params = _slab_params(torch.bfloat16)
    owned = [(o.index, o.start, o.stop) for o in owned_ranges(params, 1, 2)]
    opt = ChunkedAdamW(
        params, **HYPER, chunk_elements=8, owned=owned, grad_norm=lambda pieces: torch.tensor(1.0)
    )
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.clip_and_step(0.0)
    state = opt.state_dict()
    assert state["owned"] == owned and all(t.device.type == "cpu" for t in state["chunks"])
    again = ChunkedAdamW(_slab_params(torch.bfloat16), **HYPER, chunk_elements=8, owned=owned)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(again.state, opt.state))
    assert [None if s is None else float(s) for s in again.steps] == [
        None if s is None else float(s) for s in opt.steps
    ]
    other = [(o.index, o.start, o.stop) for o in owned_ranges(params, 0, 2)]
    with pytest.raises(ValueError, match="another ownership"):
        ChunkedAdamW(_slab_params(torch.bfloat16), **HYPER, chunk_elements=8, owned=other).load_state_dict(
            state
        )

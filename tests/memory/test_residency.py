"""Residency: module paging keeps outputs bitwise and really releases storage; saved-tensor offload
leaves gradients bitwise as without it (a small module and the tiny Qwen2.5-VL's attached prefix +
suffix); the manager applies its table per window and samples bytes as trace counters."""

from __future__ import annotations

import pytest
import torch

from rollplex.memory.host_pool import PinnedHostPool, pool_bytes
from rollplex.memory.paging import PagedModule
from rollplex.memory.residency import Residency, counter_events, resident_table
from rollplex.memory.saved_offload import SavedTensorOffload
from rollplex.memory.transfers import Transfers
from rollplex.models.forward import enable_checkpointing, prefix_states, prepare_model, suffix_logprobs
from rollplex.models.positions import VisionTokens, rope_positions
from rollplex.models.presets import init_model
from rollplex.types import Prompt, Record


def _mlp(device="cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 8),
    ).to(device)


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# -- module paging ---------------------------------------------------------------------------------


def _paged(module, device="cpu"):
    pool = PinnedHostPool(pool_bytes(p.numel() * p.element_size() for p in module.parameters()))
    return PagedModule("reference", module, pool, Transfers(device))


def test_a_paged_out_module_releases_its_storage_and_pages_in_bitwise():
    model = _mlp()
    x = torch.randn(4, 16)
    before = model(x)
    pages = _paged(model)
    ids = [id(p) for p in model.parameters()]
    pages.page_out()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert pages.resident_bytes() == {"device": 0, "host": _param_bytes(model)}
    with pytest.raises(RuntimeError):
        model(x)  # nothing is left to read
    pages.prefetch()
    pages.wait()
    assert [id(p) for p in model.parameters()] == ids  # the same tensors, as the optimizer holds them
    assert torch.equal(model(x), before)
    pages.page_out()
    pages.page_out()  # idempotent
    pages.prefetch()
    pages.wait()
    assert torch.equal(model(x), before)
    assert pages.transfers.moved["reference"]["h2d"] == 2 * _param_bytes(model)


def test_tied_weights_are_paged_once():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    pages = _paged(model)
    assert pages.nbytes == 10 * 4 * 4
    pages.page_out()
    pages.prefetch()
    assert model[1].weight.data_ptr() == model[0].weight.data_ptr()


# -- saved-tensor offload --------------------------------------------------------------------------


def _offload(module, nbytes=1 << 20, min_bytes=0, device="cpu"):
    arena = PinnedHostPool(nbytes).arena("acts", nbytes)
    return SavedTensorOffload(Transfers(device), arena, keep=module.parameters(), min_bytes=min_bytes)


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


def test_offloaded_saved_tensors_give_the_same_gradients_on_a_small_module():
    model, x = _mlp(), torch.randn(32, 16, requires_grad=True)
    model(x).square().sum().backward()
    expected, expected_x = _grads(model), x.grad.clone()
    model.zero_grad(), x.grad.zero_()
    offload = _offload(model)
    with offload.group(0):
        y = model(x).square().sum()
    assert offload.offloaded_bytes > 0 and offload.arena.used > 0
    offload.prefetch(0)
    y.backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), expected))
    assert torch.equal(x.grad, expected_x)
    assert offload.transfers.moved["prefix_activations"]["h2d"] == offload.offloaded_bytes


def test_the_backward_reads_the_host_copies():
    """Overwriting the arena between forward and backward changes the gradients: the backward really
    uses what was offloaded (so the equality above is not the device tensors' doing)."""
    model, x = _mlp(), torch.randn(32, 16, requires_grad=True)
    offload = _offload(model)
    with offload.group(0):
        y = model(x).square().sum()
    offload.arena.region.zero_()
    y.backward()
    model2 = _mlp()
    model2(x.detach().requires_grad_()).square().sum().backward()
    assert not all(torch.equal(a, b.grad) for a, b in zip(_grads(model), model2.parameters()))


def test_parameters_and_small_tensors_stay_and_reset_reuses_the_arena():
    model, x = _mlp(), torch.randn(32, 16)
    offload = _offload(model, min_bytes=32 * 64 * 4)  # [32, 64] activations move, x [32, 16] stays
    with offload.group("g"):
        model(x).sum().backward()
    sizes = {h.host.numel() * h.host.element_size() for h in offload.groups["g"]}
    assert sizes == {32 * 64 * 4}  # no [64, 64] weight among them, though large enough
    assert offload.kept_bytes >= 32 * 16 * 4  # x, saved by the first Linear, stayed
    used = offload.arena.used
    offload.reset()
    assert offload.arena.used == 0 and offload.groups == {}
    with offload.group("g"):
        model(x).sum().backward()
    assert offload.arena.used == used


def _tiny_prompt(config, grid, text, seed) -> Prompt:
    """A prompt for the tiny preset: ``text`` random text ids, then one video of ``grid`` patches."""
    g = torch.Generator().manual_seed(seed)
    rows = grid[0] * grid[1] * grid[2]
    ids = torch.randint(3, 400, (text,), generator=g).tolist()
    ids += (
        [config.vision_start_token_id] + [config.video_token_id] * (rows // 4) + [config.vision_end_token_id]
    )
    input_ids = torch.tensor(ids)
    vgrid, spg = torch.tensor([grid]), torch.tensor([1.0], dtype=torch.float64)
    positions, nxt = rope_positions(input_ids, VisionTokens.from_config(config), None, vgrid, spg)
    record = Record(0, "q", "video", "multiple choice", ("A. a",), "<answer>A</answer>", "./x.mp4", "")
    return Prompt(
        record=record,
        input_ids=input_ids,
        position_ids=positions,
        next_position=nxt,
        content_key=f"k{seed}",
        pixel_values_videos=torch.randn(rows, 1176, generator=g),
        video_grid_thw=vgrid,
        second_per_grid_ts=spg,
    )


def _prefix_suffix_grads(model, prompts, responses, offload):
    model.zero_grad()
    banned = torch.tensor([model.config.video_token_id])
    states = []
    for g, prompt in enumerate(prompts):
        with offload.group(g) if offload is not None else torch.enable_grad():
            states += prefix_states(model, [prompt], temperature=1.0, banned_ids=banned, attached=True)
    for g, state in enumerate(states):
        if offload is not None:
            offload.prefetch(g)
        logprobs, _ = suffix_logprobs(
            model, state, responses[g], group_size=2, temperature=1.0, banned_ids=banned
        )
        (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
        if offload is not None:
            offload.release(g)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [True, False], ids=["layer-recompute", "no-checkpointing"])
def test_offloaded_prefix_gives_the_same_gradients_on_the_tiny_qwen(checkpointing):
    model = init_model("tiny")
    prepare_model(model, compile_layers=False)
    if checkpointing:
        enable_checkpointing(model, layer_recompute=True)
    prompts = [_tiny_prompt(model.config, (2, 4, 4), 5, seed) for seed in (1, 2)]
    g = torch.Generator().manual_seed(3)
    responses = [torch.randint(3, 400, (2, 6), generator=g) for _ in prompts]
    expected = _prefix_suffix_grads(model, prompts, responses, None)
    offload = _offload(model, nbytes=16 << 20, min_bytes=1024)
    got = _prefix_suffix_grads(model, prompts, responses, offload)
    assert offload.transfers.moved["prefix_activations"]["d2h"] > 0
    assert got.keys() == expected.keys() and any(k.startswith("model.visual") for k in got)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


# -- the manager -----------------------------------------------------------------------------------


def test_the_manager_pages_by_its_table_and_samples_counters():
    model, x = _mlp(), torch.randn(4, 16)
    before = model(x)
    nbytes = _param_bytes(model)
    residency = Residency(
        "cpu",
        host_pool_bytes=pool_bytes([p.numel() * 4 for p in model.parameters()]),
        where=resident_table(paged=["reference"]),
    )
    residency.page("reference", model)
    residency.track("rollout_kv", lambda: {"device": 1000, "host": 0})
    places = {}
    for window in ("rollout", "scoring", "backward", "update", "rollout"):
        sample = residency.enter(window)
        places[window] = sample.device["reference"]
        if window in ("rollout", "scoring"):
            residency.wait("reference")
            assert torch.equal(model(x), before)
    assert places == {"rollout": nbytes, "scoring": nbytes, "backward": 0, "update": 0}
    assert residency.samples[2].host["reference"] == nbytes
    assert residency.samples[-1].moved["reference"] == {"h2d": nbytes, "d2h": 0}
    events = residency.counter_events(origin=residency.samples[0].time)
    assert [e["name"] for e in events[:3]] == ["device GiB", "host GiB", "moved GiB"]
    assert all(e["ph"] == "C" and e["pid"] == 0 for e in events) and events[0]["ts"] == 0.0
    assert events[0]["args"] == {"reference": nbytes / 2**30, "rollout_kv": 1000 / 2**30}
    assert events[-3]["ts"] > 0
    with pytest.raises(ValueError, match="unknown window 'decode'"):
        residency.enter("decode")


def test_counter_events_of_moved_bytes_are_cumulative_gib():
    from rollplex.memory.residency import ResidencySample

    s = ResidencySample(
        "update", 2.5, {"master": 2**30}, {"master": 2**31}, {"optimizer": {"h2d": 2**30, "d2h": 2**30}}
    )
    events = counter_events([s], origin=2.0)
    assert events == [
        {"name": "device GiB", "ph": "C", "ts": 500000.0, "pid": 0, "args": {"master": 1.0}},
        {"name": "host GiB", "ph": "C", "ts": 500000.0, "pid": 0, "args": {"master": 2.0}},
        {"name": "moved GiB", "ph": "C", "ts": 500000.0, "pid": 0, "args": {"optimizer": 2.0}},
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paging_and_offload_on_cuda_streams():
    """On CUDA: paging frees device memory and restores bitwise through the load stream; offloaded
    saved tensors reload through the streams with bitwise the same gradients."""
    model, x = _mlp("cuda"), torch.randn(64, 16, device="cuda")
    before = model(x)
    pages = _paged(model, "cuda")
    allocated = torch.cuda.memory_allocated()
    pages.page_out()
    assert torch.cuda.memory_allocated() <= allocated - _param_bytes(model)
    pages.prefetch()
    pages.wait()
    assert torch.equal(model(x), before)
    x = x.requires_grad_()
    model(x).square().sum().backward()
    expected = _grads(model)
    model.zero_grad()
    offload = _offload(model, device="cuda")
    with offload.group(0):
        y = model(x).square().sum()
    offload.prefetch(0)
    y.backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), expected))

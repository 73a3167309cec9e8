"""Profiler ranges: a torch.profiler trace of the model work shows which part of the step launched each
operator (``rollplex/phase/<name>``, ``rollplex/prefix``, ``rollplex/vision``, ``rollplex/suffix``),
one range per call; the spans reach whatever factory is installed (``hooks.set_span_factory``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rollplex.hooks import span_factory, spanned
from rollplex.models.forward import prefix_forward, suffix_logprobs
from rollplex.observe.metrics import PhaseTimer
from tests.numerics.conftest import BANNED


def _parents(event) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def test_model_work_runs_inside_its_ranges(tiny_video):
    model, prompt = tiny_video
    timer = PhaseTimer()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with timer.phase("reference"), torch.no_grad():
            prefix = prefix_forward(model, [prompt], temperature=1.0, banned_ids=BANNED, attached=False)
            suffix_logprobs(
                model, prefix, torch.tensor([[5, 6, 7]]), group_size=1, temperature=1.0, banned_ids=BANNED
            )
    events = prof.events()
    counts = {
        n: sum(e.name == n for e in events)
        for n in ("rollplex/phase/reference", "rollplex/prefix", "rollplex/vision", "rollplex/suffix")
    }
    assert counts == {
        "rollplex/phase/reference": 1,
        "rollplex/prefix": 1,
        "rollplex/vision": 1,
        "rollplex/suffix": 1,
    }
    products = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
    mm = [_parents(e) for e in events if e.name in products]
    assert any("rollplex/vision" in p and "rollplex/prefix" in p for p in mm)  # nested as called
    assert any("rollplex/suffix" in p and "rollplex/prefix" not in p for p in mm)
    assert all("rollplex/phase/reference" in p for p in mm)


def test_each_call_gets_its_own_range():
    """A fresh range per call, so nested (or concurrent) calls of one profiled function do not share one."""

    @spanned("rollplex/test")
    def work(depth: int) -> torch.Tensor:
        return torch.ones(4).sum() + (work(depth - 1) if depth else 0)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work(1)
    ranges = [e for e in prof.events() if e.name == "rollplex/test"]
    assert len(ranges) == 2
    assert sum(e.cpu_parent is not None and e.cpu_parent.name == "rollplex/test" for e in ranges) == 1


def test_a_range_closes_when_the_call_raises():
    @spanned("rollplex/test")
    def fails():
        raise RuntimeError("boom")

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with pytest.raises(RuntimeError, match="boom"):
            fails()
        torch.ones(2).sum()  # after the failed call: outside its range
    after = [e for e in prof.events() if e.name == "aten::sum"]
    assert len([e for e in prof.events() if e.name == "rollplex/test"]) == 1
    assert after and all(e.cpu_parent is None or e.cpu_parent.name != "rollplex/test" for e in after)


def test_an_installed_factory_receives_the_model_spans(tiny_video):
    """Model code opens its spans through ``rollplex.hooks``: a factory installed there sees every one,
    in call order, nested as called, and the default is back after the block."""
    model, prompt = tiny_video
    opened, depth = [], [0]

    @contextlib.contextmanager
    def recording(name):
        opened.append((depth[0], name))
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    timer = PhaseTimer()
    with span_factory(recording), timer.phase("reference"), torch.no_grad():
        prefix = prefix_forward(model, [prompt], temperature=1.0, banned_ids=BANNED, attached=False)
        suffix_logprobs(
            model, prefix, torch.tensor([[5, 6, 7]]), group_size=1, temperature=1.0, banned_ids=BANNED
        )
    assert opened == [
        (0, "rollplex/phase/reference"),
        (1, "rollplex/prefix"),
        (2, "rollplex/vision"),
        (1, "rollplex/suffix"),
    ]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        spanned("rollplex/test")(lambda: torch.ones(2).sum())()
    assert [e.name for e in prof.events()].count("rollplex/test") == 1  # the default again

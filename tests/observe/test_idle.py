"""observe.idle: idle gaps of a profile and what launched the work after each, on hand-built events
(device activity needs CUDA) and on a CPU profile of the tiny model (the launcher of its operators)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from rollplex.models.forward import prefix_forward
from rollplex.observe.idle import busy_and_gaps, gap_table, launcher
from tests.numerics.conftest import BANNED


@dataclass
class _Range:
    start: float
    end: float


@dataclass
class _Event:
    name: str
    start: float
    end: float
    device_type: DeviceType = DeviceType.CPU
    cpu_parent: _Event | None = None
    is_user_annotation: bool = False
    is_python_function: bool = False
    stack: list[str] = field(default_factory=list)

    @property
    def time_range(self) -> _Range:
        return _Range(self.start, self.end)


def test_busy_and_gaps():
    busy, gaps = busy_and_gaps([(300, 310), (0, 10), (5, 20), (320, 330), (800, 900)], 100)
    assert busy == 20 + 10 + 10 + 100
    assert gaps == [(20, 300), (330, 800)]  # 310 → 320 is under 100


def _chain(*names: str) -> _Event:
    """CPU events, outermost first; returns the innermost."""
    parent = None
    for name in names:
        parent = _Event(
            name,
            0,
            1000,
            cpu_parent=parent,
            is_user_annotation=name.startswith("rollplex/"),
            is_python_function=".py(" in name,
        )
    return parent


def test_gap_table_charges_gaps_to_the_launcher_of_the_next_work():
    """The gap ends with the first work after it, launched by the last runtime call before that; the
    device's copy of a range (a user annotation spanning the step) is not device work."""
    vision = _chain("rollplex/phase/actor", "rollplex/prefix", "rollplex/vision", "aten::linear", "aten::mm")
    copy = _chain("rollplex/phase/actor", "rollplex/prefix", "rollplex/models/forward.py(99): f", "aten::to")
    events = [
        _Event("kernel", 0, 10, DeviceType.CUDA),
        _Event("kernel", 500, 600, DeviceType.CUDA),
        _Event("kernel", 620, 700, DeviceType.CUDA),
        _Event("kernel", 1500, 1510, DeviceType.CUDA),
        _Event("rollplex/phase/actor", 0, 1510, DeviceType.CUDA, is_user_annotation=True),
        _Event("cudaLaunchKernel", 2, 3, cpu_parent=vision),
        _Event("cudaMemcpyAsync", 490, 495, cpu_parent=copy),
        _Event("cudaLaunchKernel", 610, 611, cpu_parent=vision),
        _Event("cuLaunchKernel", 1400, 1401, cpu_parent=vision),
    ]
    table = gap_table(events, min_gap_us=100)
    lines = table.splitlines()
    assert lines[0].startswith("device span 0.002 s, busy 0.000 s, idle 0.001 s; 2 gaps >= 100 us: 0.001 s")
    assert "[rollplex/vision] aten::mm < aten::linear" in lines[2] and lines[2].split()[1] == "1"  # 800 µs
    assert "[rollplex/prefix] aten::to @ rollplex/models/forward.py(99): f" in lines[3]  # 490 µs
    assert len(lines) == 4


def test_a_profile_without_device_work_is_refused():
    with pytest.raises(ValueError, match="no device activity"):
        gap_table([_Event("aten::mm", 0, 1)])


def test_launcher_on_a_profile_names_the_innermost_rollplex_range(tiny_video):
    """With Python stacks on, Python function events (named after their files, some under rollplex/)
    sit between the ranges and the operators: the range is still the innermost ``rollplex/...``
    record_function range, and the frames come from those events."""
    model, prompt = tiny_video
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof, torch.no_grad():
        prefix_forward(model, [prompt], temperature=1.0, banned_ids=BANNED, attached=False)
    keys = {launcher(e) for e in prof.events() if e.name == "aten::addmm"}
    assert keys and all(k.startswith(("[rollplex/vision] ", "[rollplex/prefix] ")) for k in keys)
    assert any(k.startswith("[rollplex/vision] aten::addmm") for k in keys)

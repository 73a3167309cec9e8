"""Where the device sat idle in a torch.profiler trace, and what the host was launching when it resumed.

A gap between device activities means the host had let the device's queue run empty (it waited for the
device, then took time to queue more). ``gap_table`` finds every gap of at least ``min_gap_us`` and
charges it to whatever launched the work that ended it: the innermost ``rollplex/...`` range
(observe.metrics: phases, prefix, suffix, vision), the operators above the runtime call, and the
innermost rollplex/transformers/torch Python frames where the profile recorded them
(``with_stack=True``). After a gap the queue was empty, so the work ending it was launched by the last
runtime call (``cudaLaunchKernel``, ``cudaMemcpyAsync``, ``cuLaunchKernel``, ...) to start before it.

Limits: the profiler links a CPU event to its parent within one thread only, so work launched by
autograd's backward thread on CUDA (backward, and the checkpointed recompute) shows no rollplex range,
only its ``autograd::engine::evaluate_function: ...`` operator. Used by ``rollplex bench profile``.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from torch.autograd import DeviceType

OUR_FRAMES = ("rollplex/", "transformers/", "torch/utils/checkpoint", "torch/autograd", "torch/optim")
RUNTIME_CALLS = ("cuda", "cuLaunch")


def busy_and_gaps(
    intervals: list[tuple[float, float]], min_gap: float
) -> tuple[float, list[tuple[float, float]]]:
    """Union length of ``intervals`` (start, end) and the gaps (start, end) of at least ``min_gap``
    between them, in time order. Units are the intervals' own (µs in a profile). ``intervals`` must not
    be empty."""
    ordered = sorted(intervals)
    busy, gaps = 0.0, []
    lo, hi = ordered[0]
    for start, end in ordered[1:]:
        if start > hi:
            busy += hi - lo
            if start - hi >= min_gap:
                gaps.append((hi, start))
            lo, hi = start, end
        else:
            hi = max(hi, end)
    return busy + hi - lo, gaps


def _is_frame(event) -> bool:
    return getattr(event, "is_python_function", False) or ".py(" in event.name


def _is_range(event) -> bool:
    return event.name.startswith("rollplex/") and not _is_frame(event)


def launcher(call) -> str:
    """``[range] op < op < op @ frame <- frame``: the innermost ``rollplex/...`` range around the profiler
    event ``call`` (a runtime call such as ``cudaLaunchKernel``), the operators above it (innermost
    first, up to three) and the innermost rollplex/transformers/torch frames (up to three) from Python
    function events or the first recorded stack."""
    names, frames, rng, event = [], [], "", call
    while event is not None:
        if _is_range(event):
            rng = rng or event.name
        elif _is_frame(event):
            if len(frames) < 3 and any(tag in event.name for tag in OUR_FRAMES):
                frames.append(event.name)
        elif not event.name.startswith(RUNTIME_CALLS) and len(names) < 3:
            names.append(event.name)
        if not frames:
            frames = [f for f in (event.stack or []) if any(tag in f for tag in OUR_FRAMES)][:3]
        event = event.cpu_parent
    head = f"[{rng or 'no rollplex range'}] " + " < ".join(names or ["(no CPU op)"])
    return head + (" @ " + " <- ".join(frames) if frames else "")


def gap_table(events, min_gap_us: float = 100.0, rows: int = 40) -> str:
    """Device span, busy and idle time of the profile ``events`` (``prof.events()`` of a torch.profiler run
    with CUDA activity; times in µs), and the gaps of at least ``min_gap_us`` summed by ``launcher``,
    longest first (``rows`` of them), as text. The device's copies of profiler ranges (user annotations)
    are not device work and are left out.

    Raises:
        ValueError: the profile holds no device activity.
    """
    device = [
        e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    if not device:
        raise ValueError("the profile holds no device activity (profile with ProfilerActivity.CUDA)")
    calls = sorted(
        (e for e in events if e.device_type == DeviceType.CPU and e.name.startswith(RUNTIME_CALLS)),
        key=lambda e: e.time_range.start,
    )
    starts = [e.time_range.start for e in calls]
    intervals = [(e.time_range.start, e.time_range.end) for e in device]
    busy, gaps = busy_and_gaps(intervals, min_gap_us)
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for start, end in gaps:
        at = bisect.bisect_right(starts, end) - 1
        key = launcher(calls[at]) if at >= 0 else "(no runtime call)"
        sums[key][0] += end - start
        sums[key][1] += 1
    lines = [
        f"device span {span / 1e6:.3f} s, busy {busy / 1e6:.3f} s, idle {(span - busy) / 1e6:.3f} s; "
        f"{len(gaps)} gaps >= {min_gap_us:.0f} us: {sum(e - s for s, e in gaps) / 1e6:.3f} s",
        "idle s  gaps  launcher of the work after the gap",
    ]
    for key, (total, count) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{total / 1e6:6.3f} {count:5d}  {key}")
    return "\n".join(lines)

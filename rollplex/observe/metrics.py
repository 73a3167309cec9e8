"""Per-step metrics: the ``metrics.jsonl`` writer, wall-clock phase timing, trace spans, progress bar.

``metrics.jsonl`` holds one JSON object per optimizer step, ``{"step": int, "<name>": float, ...}``,
in step order. Non-finite values are written as ``null`` (strict JSON). Keys the loop writes:
``reward_mean``, ``reward/<fn>``, ``accuracy``, ``format_rate``, ``kl``, ``loss``, ``clip_fraction``,
``entropy``, ``response_length`` (tokens), ``grad_norm``, ``skipped_updates`` (updates dropped for a
gradient norm that is not finite), ``skipped_samples``, ``zero_variance_groups``, ``reward_errors``,
``time/<phase>`` and ``time/step`` (seconds), ``peak_memory_gib`` and ``memory_allocated_gib`` (GiB; the
step's peak and what stays allocated after it, on CUDA), ``gc_s``, ``gc_passes`` and ``gc_full_passes``
(seconds Python's garbage collector ran during the step, its passes, and those over the oldest
generation: ``GcClock``), ``val_accuracy`` and
``val_skipped_samples`` (some steps), ``chance_accuracy``; with T-GRPO ``reward/temporal`` (the bonus),
``temporal/video_groups``, ``temporal/reward_errors``, ``temporal/ordered_accuracy``,
``temporal/shuffled_accuracy`` (the values of the compared reward, ``reward.temporal_reward``;
``accuracy`` and ``val_accuracy`` stay the built-in accuracy) and ``temporal/bonus_group_fraction``
(fraction of the video groups given the bonus).

Profiler ranges: every phase (``rollplex/phase/<name>``; the prefix-overlap schedule's Phase-1 rollout
and worker-thread prefixes included), and the model work that models.forward marks
(``rollplex/prefix``, ``rollplex/suffix``, ``rollplex/vision``), opens a trace span (``hooks.span``: a
``torch.profiler.record_function`` range by default), so a torch.profiler trace of a run shows which
part of the step launched each kernel (observe.idle charges idle device time to them). torch.profiler
records the thread that started it; the worker thread's ranges show only where the profiler is set to
record other threads too.

Chrome trace: ``write_chrome_trace`` writes the Trace Event Format (complete events, ``"ph": "X"``,
microseconds; https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU), one
thread row per stream label; open it in Perfetto or chrome://tracing.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from rollplex import hooks
from rollplex.types import StepStats

METRICS_FILE = "metrics.jsonl"
TRACE_FILE = "trace.json"  # a run folder's Chrome trace (loop.train writes it, observe.report draws it)
log = logging.getLogger("rollplex")


def _json_value(value: float | bool) -> float | int | None:
    """A metric value as strict JSON: ints and bools kept as ints, non-finite floats as None."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


def _read_lines(path: Path) -> list[dict]:
    """Parse ``path`` line by line; a torn last line (no newline, not JSON) from a killed writer is dropped.

    Raises ``ValueError`` naming the path and line number for any other unparseable line.
    """
    text = path.read_text()
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from exc
    return rows


def read_metrics(run_dir: Path) -> list[dict]:
    """All rows of ``run_dir/metrics.jsonl`` in file order (``null`` values read back as None).

    Raises ``ValueError`` naming the path when the file is missing or holds no rows.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"metrics file {str(path)!r} does not exist")
    rows = _read_lines(path)
    if not rows:
        raise ValueError(f"metrics file {str(path)!r} is empty")
    return rows


class MetricsWriter:
    """Appends one JSON line per step to ``run_dir/metrics.jsonl``, flushed after each line.

    Args:
        run_dir: run folder (created if missing).
        resume_step: None starts an empty file; an int keeps only the rows with ``step <= resume_step``
            (a resumed run rewrites the steps after its checkpoint, so curves are not duplicated).

    Example:
        writer = MetricsWriter(run_dir, resume_step=None)
        writer.write(StepStats(step=1, values={"reward_mean": 0.5, "time/step": 2.1}))
        writer.write({"step": 2, "reward_mean": 0.625, "time/step": 2.0})
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step is not None and self.path.is_file():
            kept = [row for row in _read_lines(self.path) if row.get("step", math.inf) <= resume_step]
        tmp = self.path.with_name(f".{METRICS_FILE}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, self.path)

    def write(self, stats: StepStats | Mapping[str, float]) -> None:
        """Append one step as one line (the file is opened, written and closed, so each line is flushed).

        ``stats`` is a ``StepStats`` (written as ``{"step": stats.step, **stats.values}``) or a flat mapping
        with an int ``"step"`` key and float/int/bool values.
        """
        if isinstance(stats, StepStats):
            stats = {"step": stats.step, **stats.values}
        assert isinstance(stats.get("step"), int), (
            f"metrics row needs an int 'step', got {stats.get('step')!r}"
        )
        row = {k: v if k == "step" else _json_value(v) for k, v in stats.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")

    def close(self) -> None:
        """Nothing to release: each line was written with the file opened and closed."""


@dataclass(frozen=True)
class Span:
    """One timed interval: ``start``/``end`` in seconds of ``time.perf_counter``, phase name, stream label,
    and the optimizer step it belongs to (1-based, as ``metrics.jsonl`` numbers steps; None outside a
    training loop)."""

    start: float
    end: float
    name: str
    stream: str
    step: int | None = None


class PhaseTimer:
    """Wall-clock seconds per phase of the current step, and the spans of every phase for a trace.

    Args:
        sync: called before each clock reading (``torch.cuda.synchronize`` on GPU, so that queued kernels
            count in the phase that launched them); None on CPU.
        clock: seconds counter (``time.perf_counter``; tests pass a fake).

    Phases with the same name in one step add up. Nested phases are timed independently (an outer
    ``"step"`` phase includes its inner phases). ``step``, when the caller sets it, stamps every span
    recorded from then on (the trace then names each span's optimizer step).

    Example:
        timer = PhaseTimer()
        with timer.phase("rollout"):
            ...
        timer.pop()  # {"time/rollout": 1.93}
    """

    def __init__(
        self, sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter
    ):
        self._sync = sync
        self._clock = clock
        self._totals: dict[str, float] = defaultdict(float)
        self.spans: list[Span] = []
        self.step: int | None = None

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return self._clock()

    @contextmanager
    def phase(self, name: str, stream: str = "main", count: bool = True) -> Iterator[None]:
        """Time the body as phase ``name`` on the trace row ``stream`` (and mark it as the profiler range
        ``rollplex/phase/<name>``, ``hooks.span``); ``count`` as in ``record``."""
        start = self._now()
        try:
            with hooks.span(f"rollplex/phase/{name}"):
                yield
        finally:
            self.record(name, start, self._now(), stream, count)

    def now(self) -> float:
        """The clock after the timer's sync (for spans timed by their owner, see ``record``)."""
        return self._now()

    def record(self, name: str, start: float, end: float, stream: str = "main", count: bool = True) -> None:
        """Add a span timed elsewhere (e.g. by a worker thread that synchronises only its own stream);
        with ``count`` False it goes to the trace only, not to the phase times ``pop`` returns (work
        between steps, such as evaluation and checkpoints)."""
        if count:
            self._totals[name] += end - start
        self.spans.append(Span(start, end, name, stream, self.step))

    def pop(self) -> dict[str, float]:
        """``{"time/<phase>": seconds}`` accumulated since the last pop, in first-use order; then reset."""
        out = {f"time/{name}": seconds for name, seconds in self._totals.items()}
        self._totals = defaultdict(float)
        return out


# Steps that must be left for a freeze to pay: a pass over the whole heap comes once in several steps of
# a GRPO run (GcClock; how often, and what it costs, in benchmarks/README.md).
FREEZE_MIN_STEPS_LEFT = 8


def _worth_freezing(steps_left: int | None) -> bool:
    return steps_left is None or steps_left >= FREEZE_MIN_STEPS_LEFT


class GcClock:
    """Python's cyclic garbage collector over a run or benchmark row, the one place that times it and
    tunes it: the seconds and passes of each step (``gc.callbacks``, read with ``pop``), and the
    long-lived heap kept out of later passes once the first step has built it (``step_done``).

    A pass over the oldest generation (CPython 3.12) visits every object the process holds: the
    models, transformers' modules, torch.compile's caches. Such a pass is step time wherever the host
    is on the critical path (its share of a step: benchmarks/README.md). After the first step (which compiles
    and captures), unless fewer than ``FREEZE_MIN_STEPS_LEFT`` steps are left, ``step_done`` runs one full
    pass and then ``gc.freeze()``: what is alive then moves to the permanent generation, which later passes
    skip. Those objects are still freed by reference counting, but a reference cycle that includes one of
    them, and everything the cycle references, is kept until the heap is unfrozen: at ``refreeze`` (the
    training loop calls it at each checkpoint with at least ``FREEZE_MIN_STEPS_LEFT`` steps after it, outside
    the step times; a pass over the whole heap each but where no step has ended since the freeze, so a
    checkpoint every step costs one such pass per step) and at ``__exit__``, after which the next pass frees
    what has died (a benchmark row's models, say). Where the process had frozen objects before ``__enter__``
    (someone else's freeze), this clock freezes nothing and unfreezes nothing; someone else's freeze after
    ``__enter__`` is not told apart and is unfrozen with the clock's. The collector runs in whichever thread
    allocates, the worker thread included; passes do not overlap (they hold the GIL).

    Args:
        clock: seconds counter (``time.perf_counter``; tests pass a fake).

    Example:
        with GcClock() as gc_clock:
            ...  # a step
            gc_clock.pop()  # {"gc_s": 0.02, "gc_passes": 104, "gc_full_passes": 0}
            gc_clock.step_done()
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._start: float | None = None
        self._done: list[tuple[float, bool]] = []  # (seconds, full) per pass since the last pop
        self.frozen = False
        self._may_freeze = False
        self._stepped = False  # a step has ended since the last freeze (refreeze has something to do)

    def __enter__(self) -> GcClock:
        self._may_freeze = gc.get_freeze_count() == 0
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._unfreeze()
        finally:
            with contextlib.suppress(ValueError):  # taken out elsewhere: not worth hiding an error for
                gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = self._clock()
        elif self._start is not None:  # "stop" of a pass whose start this clock saw
            entry = (self._clock() - self._start, info["generation"] == 2)
            self._done.append(entry)  # no thread switch between reading the list and appending
            self._start = None

    def pop(self) -> dict[str, float | int]:
        """``{"gc_s": seconds, "gc_passes": passes, "gc_full_passes": passes over the oldest generation}``
        since the last pop (or ``__enter__``); then reset. A pass that ends while this runs lands in
        this pop or the next, never in neither."""
        done, self._done = self._done, []
        return {
            "gc_s": sum((seconds for seconds, _ in done), 0.0),
            "gc_passes": len(done),
            "gc_full_passes": sum(full for _, full in done),
        }

    def step_done(self, steps_left: int | None = None) -> None:
        """Call between steps. After the first: one full pass, then the survivors frozen out of later
        passes (see the class). After later steps it only notes that a step has ended (``refreeze``
        has something to do), and it freezes nothing where ``steps_left`` (the steps still to
        run; None: a long run) is under ``FREEZE_MIN_STEPS_LEFT``: fewer than one pass over the whole
        heap is expected before the end, so the full pass before freezing would cost about what it
        saves."""
        if _worth_freezing(steps_left) and self._may_freeze and not self.frozen:
            self._freeze()
        else:
            self._stepped = True

    def refreeze(self, steps_left: int | None = None) -> None:
        """Between steps, once frozen: unfreeze, one full pass (which frees any cycle that died among the
        frozen objects), and freeze again. A no-op before the first ``step_done``, where no step has
        ended since the last freeze (a checkpoint right after the first step, whose freeze has just
        run a full pass), and where ``steps_left`` is under ``FREEZE_MIN_STEPS_LEFT`` (the end of the
        run, which unfreezes, is near)."""
        if self.frozen and self._stepped and _worth_freezing(steps_left):
            self._unfreeze()
            self._freeze()

    def _freeze(self) -> None:
        gc.collect()
        self.frozen = True  # before the freeze: an interrupt after it still finds it undone
        self._stepped = False
        gc.freeze()

    def _unfreeze(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False


@dataclass(frozen=True)
class CounterSample:
    """Values of a counter track at one moment (Chrome's ``"ph": "C"`` event: one track per ``name``, one
    series per key of ``values``), e.g. the device GiB of each memory state class as a window begins.
    ``time`` is in seconds of ``time.perf_counter`` (the spans' clock)."""

    name: str
    time: float
    values: dict[str, float]


def chrome_trace(
    spans: list[Span],
    base: dict | None = None,
    resume_step: int | None = None,
    counters: list[CounterSample] = (),
) -> dict:
    """Trace Event Format dict: one ``"X"`` event per span (µs from the first span), one thread per stream;
    a span's optimizer step goes to its event's ``args`` as ``{"step": n}``; one ``"C"`` event per
    counter sample, on the spans' time axis.

    With ``base`` (the trace of the run's earlier processes, before a resume), its events come first,
    unchanged, but for the spans of steps after ``resume_step`` (the step the run resumed at: a run
    resumed from an older checkpoint trains those steps again, and their new spans replace the old);
    the spans follow from the last kept event's end, after an instant event ``"resumed"`` there, and a
    stream the base already names keeps its thread.
    """
    earlier = [e for e in (base.get("traceEvents", []) if base else []) if not _after(e, resume_step)]
    tids = {
        e["args"]["name"]: e["tid"] for e in earlier if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    named = set(tids)
    offset = max((e["ts"] + e.get("dur", 0.0) for e in earlier if e.get("ph") in ("X", "i")), default=0.0)
    origin = min((s.start for s in spans), default=0.0)
    events = []
    if earlier and spans:
        mark = {"name": "resumed", "ph": "i", "s": "g", "ts": offset, "pid": 0, "tid": 0}
        if resume_step is not None:  # the mark goes with the steps it precedes, should those be retrained
            mark["args"] = {"step": resume_step + 1}
        events.append(mark)
    for span in spans:
        tid = tids.setdefault(span.stream, max(tids.values(), default=-1) + 1)
        start_us = offset + (span.start - origin) * 1e6
        event = {
            "name": span.name,
            "ph": "X",
            "ts": start_us,
            "dur": (span.end - span.start) * 1e6,
            "pid": 0,
            "tid": tid,
        }
        if span.step is not None:
            event["args"] = {"step": span.step}
        events.append(event)
    for sample in counters:
        ts = offset + (sample.time - origin) * 1e6
        events.append({"name": sample.name, "ph": "C", "ts": ts, "pid": 0, "args": dict(sample.values)})
    names = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": s}}
        for s, t in tids.items()
        if s not in named
    ]
    return {"traceEvents": earlier + names + events, "displayTimeUnit": "ms"}


def _after(event: dict, step: int | None) -> bool:
    """Whether ``event`` is a span or instant of an optimizer step after ``step`` (never for None)."""
    args = event.get("args")
    stamped = args.get("step") if isinstance(args, dict) else None
    return step is not None and event.get("ph") in ("X", "i") and _integer(stamped) and stamped > step


def write_chrome_trace(
    spans: list[Span],
    path: Path,
    base: dict | None = None,
    resume_step: int | None = None,
    counters: list[CounterSample] = (),
) -> None:
    """Write ``chrome_trace(spans, base, resume_step, counters)`` as JSON to ``path``, through a temporary sibling
    replaced onto it, so a write interrupted by the process's end leaves the previous trace in place
    (the file is not synced to disk: a machine's crash may still leave it empty, and
    ``read_chrome_trace`` then starts a new one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(chrome_trace(spans, base, resume_step, counters)))
    os.replace(tmp, path)


def read_chrome_trace(path: Path) -> dict | None:
    """The trace at ``path`` (to continue it after a resume); None where there is none, or where it is
    not a trace (a warning names the file, and the resumed run starts a new one)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        trace = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        log.warning("%s is not a readable trace (%s): the resumed run starts a new one", path, err)
        return None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list) or not all(_continuable(e) for e in events):
        log.warning("%s is not a Chrome trace: the resumed run starts a new one", path)
        return None
    return trace


def _continuable(event) -> bool:
    """Whether ``chrome_trace`` can continue after ``event``: a thread name with its integer thread, or a
    span or instant with a finite time (other event kinds, such as a process name, are kept as they
    are)."""
    if not isinstance(event, dict):
        return False
    if event.get("ph") == "M" and event.get("name") == "thread_name":
        args = event.get("args")
        return _integer(event.get("tid")) and isinstance(args, dict) and isinstance(args.get("name"), str)
    if event.get("ph") in ("X", "i"):
        return "ts" in event and all(_finite(event.get(k, 0.0)) for k in ("ts", "dur"))
    return True


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


POSTFIX_KEYS = (
    ("reward", "reward_mean", "{:.3f}"),
    ("acc", "accuracy", "{:.3f}"),
    ("s/step", "time/step", "{:.1f}"),
)


def postfix(step_metrics: Mapping[str, float | None]) -> dict[str, str]:
    """Short progress-bar fields (reward, acc, s/step) from one step's metrics; missing or None keys skipped."""
    return {
        label: fmt.format(step_metrics[key])
        for label, key, fmt in POSTFIX_KEYS
        if step_metrics.get(key) is not None
    }


class ProgressBar:
    """tqdm bar over optimizer steps with ETA and a short postfix (reward, acc, s/step).

    While the bar is shown, log records that the root logger's console handlers (stderr, stdout) would
    print are written on their own lines above it (``tqdm.contrib.logging.logging_redirect_tqdm``: the
    bar is cleared, the line written, the bar drawn again), so a warning such as a skipped sample is not
    appended to the bar's line. ``close`` (or leaving a ``with`` block) puts the handlers back.

    Args:
        total: steps of the whole run. initial: steps already done (resume). enabled: False shows nothing.
        file: stream to draw on (tqdm default: stderr).
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, file: IO[str] | None = None):
        self._bar = tqdm(
            total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, file=file
        )
        self._redirect = contextlib.ExitStack()
        if enabled:
            self._redirect.enter_context(logging_redirect_tqdm(tqdm_class=tqdm))

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, step_metrics: Mapping[str, float | None]) -> None:
        """Advance one step and show its postfix fields."""
        self._bar.set_postfix(postfix(step_metrics), refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
        self._redirect.close()

"""metrics.jsonl writer/reader, phase timing with a fake clock, Chrome trace, progress bar."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import sys
import weakref

import pytest

from rollplex.observe import metrics as metrics_module
from rollplex.observe.metrics import (
    GcClock,
    MetricsWriter,
    PhaseTimer,
    ProgressBar,
    Span,
    chrome_trace,
    postfix,
    read_metrics,
    write_chrome_trace,
)
from rollplex.types import StepStats


def _steps(run_dir) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir)]


def test_lines_are_flushed_as_written(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(StepStats(step=1, values={"reward_mean": 0.5, "loss": -0.25}))
    writer.write({"step": 2, "reward_mean": 0.75, "kl": 1e-3})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "reward_mean": 0.5, "loss": -0.25},
        {"step": 2, "reward_mean": 0.75, "kl": 0.001},
    ]


def test_values_are_strict_json(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(StepStats(step=1, values={"loss": float("nan"), "kl": float("inf"), "flag": True, "n": 3}))
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert read_metrics(tmp_path) == [{"step": 1, "loss": None, "kl": None, "flag": 1, "n": 3}]


def test_resume_truncates_later_steps(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in range(1, 6):
        writer.write(StepStats(step=step, values={"reward_mean": step / 10}))
    writer = MetricsWriter(tmp_path, resume_step=3)
    assert _steps(tmp_path) == [1, 2, 3]
    writer.write(StepStats(step=4, values={"reward_mean": 9.0}))
    rows = read_metrics(tmp_path)
    assert _steps(tmp_path) == [1, 2, 3, 4]
    assert rows[2]["reward_mean"] == 0.3 and rows[3]["reward_mean"] == 9.0


def test_fresh_writer_starts_empty(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(StepStats(step=1, values={"loss": 1.0}))
    writer = MetricsWriter(tmp_path, resume_step=None)
    writer.write(StepStats(step=1, values={"loss": 2.0}))
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]


def test_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    assert _steps(tmp_path) == [1, 2]
    writer = MetricsWriter(tmp_path, resume_step=2)
    writer.write(StepStats(step=3, values={"loss": 3.0}))
    assert read_metrics(tmp_path)[-1] == {"step": 3, "loss": 3.0}


def test_read_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"metrics\.jsonl.*does not exist"):
        read_metrics(tmp_path)
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl.*empty"):
        read_metrics(tmp_path)
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2:"):
        read_metrics(tmp_path)


def test_phase_timer_with_fake_clock():
    ticks = iter([0.0, 1.5, 2.0, 2.25, 3.0, 4.0, 10.0, 10.5])
    syncs = []
    timer = PhaseTimer(sync=lambda: syncs.append(1), clock=lambda: next(ticks))
    with timer.phase("rollout"):
        pass
    with timer.phase("actor", stream="train"):
        pass
    with pytest.raises(RuntimeError), timer.phase("rollout"):
        raise RuntimeError("a failing phase is still timed")
    assert timer.pop() == {"time/rollout": 2.5, "time/actor": 0.25}
    assert len(syncs) == 6
    with timer.phase("optimizer"):
        pass
    assert timer.pop() == {"time/optimizer": 0.5}
    assert timer.pop() == {}
    assert timer.spans == [
        Span(0.0, 1.5, "rollout", "main"),
        Span(2.0, 2.25, "actor", "train"),
        Span(3.0, 4.0, "rollout", "main"),
        Span(10.0, 10.5, "optimizer", "main"),
    ]


def test_chrome_trace_events(tmp_path):
    spans = [
        Span(5.0, 5.5, "rollout", "decode"),
        Span(5.25, 6.0, "prefix", "prefix"),
        Span(6.0, 6.125, "opt", "decode"),
    ]
    trace = chrome_trace(spans)
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {(e["tid"], e["args"]["name"]) for e in meta} == {(0, "decode"), (1, "prefix")}
    assert [(e["name"], e["ts"], e["dur"], e["tid"]) for e in events] == [
        ("rollout", 0.0, 500000.0, 0),
        ("prefix", 250000.0, 750000.0, 1),
        ("opt", 1000000.0, 125000.0, 0),
    ]
    path = tmp_path / "trace.json"
    write_chrome_trace(spans, path)
    assert json.loads(path.read_text()) == trace
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}


def test_spans_carry_the_step_the_timer_is_at_and_the_trace_names_it():
    ticks = iter([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    timer = PhaseTimer(clock=lambda: next(ticks))
    with timer.phase("data"):  # before a loop sets the step
        pass
    timer.step = 7
    with timer.phase("rollout"):
        pass
    timer.record("prefix", 2.5, 2.75, "prefix")  # a span timed by a worker thread
    assert [s.step for s in timer.spans] == [None, 7, 7]
    events = [e for e in chrome_trace(timer.spans)["traceEvents"] if e["ph"] == "X"]
    assert [e.get("args") for e in events] == [None, {"step": 7}, {"step": 7}]


def test_a_run_resumed_at_an_earlier_step_replaces_the_later_steps_spans():
    """Resumed at step 2 from a trace of steps 1-3 (a later checkpoint was lost): step 3's spans and a
    mark of an earlier resume before step 3 go, unstamped events stay, the new spans follow from the
    end of step 2, after a mark stamped with the step it precedes."""
    first = [Span(float(i), i + 0.5, "rollout", "main", i) for i in (1, 2, 3)]
    base = chrome_trace(first)
    base["traceEvents"].insert(
        2, {"name": "resumed", "ph": "i", "s": "g", "ts": 2e6, "pid": 0, "tid": 0, "args": {"step": 3}}
    )
    base["traceEvents"].append({"name": "old", "ph": "X", "ts": 9e6, "dur": 1.0, "pid": 0, "tid": 0})
    trace = chrome_trace([Span(40.0, 40.5, "rollout", "main", 3)], base, resume_step=2)
    spans = [(e["name"], e["ts"], e.get("args")) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans == [
        ("rollout", 0.0, {"step": 1}),
        ("rollout", 1e6, {"step": 2}),
        ("old", 9e6, None),
        ("rollout", 9e6 + 1.0, {"step": 3}),
    ]
    marks = [(e["ts"], e["args"]) for e in trace["traceEvents"] if e["ph"] == "i"]
    assert marks == [(9e6 + 1.0, {"step": 3})]
    assert chrome_trace([], base, resume_step=5)["traceEvents"] == base["traceEvents"]  # nothing after 5


def test_postfix_fields():
    assert postfix({"reward_mean": 0.5, "accuracy": 0.25, "time/step": 2.04, "loss": 1.0}) == {
        "reward": "0.500",
        "acc": "0.250",
        "s/step": "2.0",
    }
    assert postfix({"reward_mean": None, "time/step": 12.0}) == {"s/step": "12.0"}


def test_progress_bar_shows_position_and_postfix():
    out = io.StringIO()
    bar = ProgressBar(total=10, initial=3, enabled=True, file=out)
    bar.update({"reward_mean": 0.5, "accuracy": 0.25, "time/step": 2.0})
    bar.close()
    text = out.getvalue()
    assert "4/10" in text and "reward=0.500" in text and "acc=0.250" in text and "s/step=2.0" in text
    quiet = io.StringIO()
    bar = ProgressBar(total=10, initial=0, enabled=False, file=quiet)
    bar.update({"reward_mean": 0.5})
    bar.close()
    assert quiet.getvalue() == ""


def _screen(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: ``\\r`` returns to the line's start, later characters
    overwrite earlier ones, ``\\n`` starts a new line."""
    lines, line, col = [], [], 0
    for char in text:
        if char == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif char == "\r":
            col = 0
        else:
            line[col : col + 1] = [char]
            col += 1
    return [*lines, "".join(line).rstrip()]


@pytest.mark.parametrize("redirected", [True, False])
def test_a_warning_is_its_own_line_above_the_bar(monkeypatch, redirected):
    """A warning logged between two steps (a skipped sample) shows on a line of its own, with the bar
    drawn again below it; without the bar's redirection (``redirected`` False, what the loop did
    before) the same warning is appended to the bar's line, and the test's check sees it."""
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    handler = logging.StreamHandler(sys.stderr)  # what logging.basicConfig installs
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    monkeypatch.setattr(root, "level", logging.INFO)
    if not redirected:
        monkeypatch.setattr(metrics_module, "logging_redirect_tqdm", lambda **_: contextlib.nullcontext())
    warning = "skipping problem_id 7 (clip.mp4): cannot decode"
    with ProgressBar(total=3) as bar:
        bar.update({"reward_mean": 0.5})
        logging.getLogger("rollplex").warning(warning)
        bar.update({"reward_mean": 0.5})
    assert root.handlers == [handler]  # put back
    shown = _screen(stderr.getvalue())
    assert (warning in shown) == redirected, shown
    if redirected:
        assert "2/3" in shown[shown.index(warning) + 1]  # the bar, below it


def test_a_resumed_trace_continues_the_earlier_one(tmp_path, caplog):
    """After a resume the earlier events stay as they were, the new spans follow from the earlier end
    after a "resumed" mark, a known stream keeps its thread and a new one gets the next; the file is
    replaced whole (no temporary left), and an unreadable trace is replaced with a warning."""
    from rollplex.observe.metrics import read_chrome_trace

    path = tmp_path / "trace.json"
    write_chrome_trace([Span(1.0, 2.0, "rollout", "main"), Span(1.5, 3.0, "prefix", "prefix")], path)
    earlier = read_chrome_trace(path)
    write_chrome_trace(
        [Span(50.0, 50.5, "rollout", "main"), Span(50.25, 51.0, "decode", "decode")], path, earlier
    )
    trace = json.loads(path.read_text())
    assert trace["traceEvents"][: len(earlier["traceEvents"])] == earlier["traceEvents"]
    spans = [(e["name"], e["ts"], e["dur"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans == [
        ("rollout", 0.0, 1e6, 0),
        ("prefix", 0.5e6, 1.5e6, 1),
        ("rollout", 2e6, 0.5e6, 0),
        ("decode", 2.25e6, 0.75e6, 2),
    ]
    marks = [(e["name"], e["ts"]) for e in trace["traceEvents"] if e["ph"] == "i"]
    assert marks == [("resumed", 2e6)]
    names = [(e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M"]
    assert names == [(0, "main"), (1, "prefix"), (2, "decode")]  # each stream named once
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]
    assert read_chrome_trace(tmp_path / "missing.json") is None
    other = {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rollplex"}}
    path.write_text(json.dumps({"traceEvents": [other, *earlier["traceEvents"]]}))
    assert read_chrome_trace(path)["traceEvents"][0] == other  # kept as it is
    bad_events = [
        {"ph": "X", "ts": "late"},
        {"ph": "X", "ts": True, "dur": 1.0},
        {"ph": "i", "ts": float("nan")},
        {"ph": "M", "name": "thread_name", "tid": 0, "args": "main"},
        {"ph": "M", "name": "thread_name", "tid": False, "args": {"name": "main"}},
    ]
    for text in ("{ torn", "[1, 2]", *(json.dumps({"traceEvents": [e]}) for e in bad_events)):
        path.write_text(text)
        with caplog.at_level("WARNING"):
            assert read_chrome_trace(path) is None
        assert "the resumed run starts a new one" in caplog.text
        caplog.clear()


def test_the_gc_clock_times_the_collectors_passes_while_entered(no_automatic_gc):
    """Each pass from its "start" to its "stop" callback, on the given clock; ``pop`` hands over and
    resets; after ``__exit__`` the callback is gone and passes no longer reach the clock."""
    ticks = iter([10.0, 10.5, 20.0, 20.25])
    read = []
    callbacks = list(gc.callbacks)
    with GcClock(clock=lambda: read.append(1) or next(ticks)) as gc_clock:
        gc.collect()
        assert gc_clock.pop() == {"gc_s": 0.5, "gc_passes": 1, "gc_full_passes": 1}
        assert gc_clock.pop() == {"gc_s": 0.0, "gc_passes": 0, "gc_full_passes": 0}
        gc.collect(0)  # the youngest generation only: a pass, not a full one
    assert gc.callbacks == callbacks
    gc.collect()
    assert len(read) == 4  # the last pass did not read the clock
    assert gc_clock.pop() == {"gc_s": 0.25, "gc_passes": 1, "gc_full_passes": 0}


class _Node:
    """An object that can sit in a reference cycle and be watched with a weak reference."""

    other: _Node | None = None


def _cycle() -> weakref.ref:
    """A two-object reference cycle nothing else holds; a weak reference to one of them."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def _kept_cycle() -> _Node:
    """An object in a reference cycle with itself, kept by the caller."""
    node = _Node()
    node.other = node
    return node


def test_after_the_first_step_the_survivors_are_frozen_until_exit_and_garbage_is_not(no_automatic_gc):
    """``step_done`` after the first step: garbage of that step (a dead cycle) is collected, not frozen;
    what is alive moves to the permanent generation, once (what a later step leaves is not frozen);
    ``__exit__`` unfreezes it, so a cycle that died meanwhile is collected by the next pass."""
    assert gc.get_freeze_count() == 0
    dead_before = _cycle()
    with GcClock() as gc_clock:
        kept = _kept_cycle()  # alive when the first step is done
        gc_clock.step_done()
        assert dead_before() is None  # collected by the step's full pass, not frozen
        frozen = gc.get_freeze_count()
        assert frozen > 0 and gc_clock.frozen
        later = _kept_cycle()  # alive when the second step is done
        gc_clock.step_done()
        assert gc.get_freeze_count() <= frozen  # nothing more frozen (reference counting may free some)
        watch_later = weakref.ref(later)
        del later
        gc.collect()
        assert watch_later() is None  # not frozen: collected while still entered
        watch = weakref.ref(kept)
        del kept
        gc.collect()
        assert watch() is not None  # frozen: its cycle is out of the collector's reach
    assert gc.get_freeze_count() == 0 and not gc_clock.frozen
    gc.collect()
    assert watch() is None


def test_refreeze_frees_a_cycle_that_died_among_the_frozen_objects(no_automatic_gc):
    """``refreeze`` (the loop's, at each checkpoint): a frozen cycle that has died is collected, and the
    survivors are frozen again; before the first ``step_done`` it does nothing, and right after the
    freeze (no step since: a checkpoint after the first step) it runs no second full pass."""
    passes = []
    with GcClock() as gc_clock:
        gc.callbacks.append(
            lambda phase, info: passes.append(info["generation"]) if phase == "stop" else None
        )
        try:
            gc_clock.refreeze()
            assert gc.get_freeze_count() == 0 and passes == []
            kept = _kept_cycle()
            gc_clock.step_done()
            watch = weakref.ref(kept)
            del kept
            gc_clock.refreeze()
            assert passes == [2] and watch() is not None  # no step since the freeze: nothing done
            gc_clock.step_done()  # the next step
            gc_clock.refreeze()
            gc_clock.refreeze()  # again, with no step between: nothing more
            assert passes == [2, 2] and watch() is None and gc.get_freeze_count() > 0 and gc_clock.frozen
        finally:
            gc.callbacks.pop()
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_its_heap_itself_keeps_it_frozen(no_automatic_gc):
    """Objects frozen before ``__enter__`` are someone else's: the clock neither freezes more nor
    unfreezes them. Told by what a full pass collects, not by ``gc.get_freeze_count()``, which drops
    whenever reference counting frees any frozen object, including ones the test did not create."""
    theirs = _kept_cycle()
    gc.freeze()
    try:
        watch_theirs = weakref.ref(theirs)
        del theirs  # only its own cycle holds it now: frozen, no pass can collect it
        with GcClock() as gc_clock:
            ours = _kept_cycle()
            gc_clock.step_done()
            gc_clock.refreeze()
            assert not gc_clock.frozen
            watch_ours = weakref.ref(ours)
            del ours
            gc.collect()
            assert watch_ours() is None  # not frozen by the clock
        gc.collect()
        assert watch_theirs() is not None  # still frozen after the clock's exit
    finally:
        gc.unfreeze()
    gc.collect()
    assert watch_theirs() is None  # unfrozen, it is garbage: the check above could have failed


def test_a_run_about_to_end_freezes_nothing(no_automatic_gc):
    """Fewer steps left than ``FREEZE_MIN_STEPS_LEFT``: no full pass is likely to come, so neither
    ``step_done`` nor ``refreeze`` runs one; with enough left, or with no count (a long run), they do."""
    from rollplex.observe.metrics import FREEZE_MIN_STEPS_LEFT

    passes = []
    with GcClock() as gc_clock:
        gc.callbacks.append(
            lambda phase, info: passes.append(info["generation"]) if phase == "stop" else None
        )
        try:
            gc_clock.step_done(FREEZE_MIN_STEPS_LEFT - 1)
            assert not gc_clock.frozen and passes == []
            gc_clock.step_done(FREEZE_MIN_STEPS_LEFT)
            assert gc_clock.frozen and passes == [2]
            gc_clock.step_done(FREEZE_MIN_STEPS_LEFT - 1)  # a later step, near the end
            gc_clock.refreeze(FREEZE_MIN_STEPS_LEFT - 1)
            assert passes == [2]
            gc_clock.refreeze()
            assert gc_clock.frozen and passes == [2, 2]
        finally:
            gc.callbacks.pop()

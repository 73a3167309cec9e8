"""Report: table helpers against hand-computed values, PNGs from synthetic metrics, missing data."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from rollplex.observe.metrics import MetricsWriter
from rollplex.observe.report import (
    DIAGNOSTICS,
    accuracy_figure,
    bench_report,
    diagnostics_figure,
    eq1_figure,
    keys_with_prefix,
    make_report,
    mean_breakdown,
    rewards_figure,
    series,
    step_time_figure,
    step_times,
)


def _synthetic_rows(steps: int = 12) -> list[dict]:
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "reward_mean": 0.1 * step,
            "reward/accuracy": 0.05 * step,
            "reward/format": 0.9,
            "accuracy": min(1.0, 0.08 * step),
            "chance_accuracy": 0.25,
            "loss": 1.0 / step,
            "kl": 0.001 * step,
            "clip_fraction": 0.0,
            "entropy": 2.0,
            "time/rollout": 1.0,
            "time/actor": 0.5 + 0.01 * step,
            "time/optimizer": 0.2,
            "time/step": 2.0,
        }
        if step % 4 == 0:
            row["val_accuracy"] = 0.3 + 0.02 * step
        rows.append(row)
    return rows


def _write(run_dir, rows) -> None:
    writer = MetricsWriter(run_dir)
    for row in rows:
        writer.write(row)


def test_series_skips_missing_and_null():
    rows = [{"step": 1, "a": 1.0}, {"step": 2}, {"step": 3, "a": None}, {"step": 4, "a": 4}]
    assert series(rows, "a") == ([1, 4], [1.0, 4.0])
    assert series(rows, "b") == ([], [])


def test_keys_with_prefix_first_seen_order():
    rows = [{"step": 1, "time/b": 1, "time/step": 2}, {"step": 2, "time/a": 1, "time/b": 2}]
    assert keys_with_prefix(rows, "time/") == ["time/b", "time/step", "time/a"]
    assert keys_with_prefix(rows, "time/", exclude=("time/step",)) == ["time/b", "time/a"]


def test_step_times_and_mean_breakdown_by_hand():
    rows = [
        {"step": 1, "time/a": 1.0, "time/b": 2.0, "time/step": 4.0},
        {"step": 2, "time/a": 3.0, "time/step": 3.0},
        {"step": 3, "reward_mean": 1.0},
    ]
    steps, table = step_times(rows)
    assert steps == [1, 2]
    assert table == {"a": [1.0, 3.0], "b": [2.0, 0.0], "other": [1.0, 0.0]}
    assert mean_breakdown(table) == {"a": 2.0, "b": 1.0, "other": 0.5}
    # phases that add up to time/step leave no "other"
    assert step_times([{"step": 1, "time/a": 1.5, "time/step": 1.5}])[1] == {"a": [1.5]}


def _assert_png(path, size):
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == size
        image.verify()
    with Image.open(path) as image:
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is not None and len(colors) > 10  # something was drawn


def test_make_report_writes_valid_pngs(tmp_path):
    _write(tmp_path, _synthetic_rows())
    paths = make_report(tmp_path)
    names = ["rewards.png", "accuracy.png", "step_time.png", "training.png"]
    assert paths == [tmp_path / "report" / name for name in names]
    _assert_png(paths[0], (800, 450))
    _assert_png(paths[1], (800, 450))
    _assert_png(paths[2], (1200, 450))
    _assert_png(paths[3], (1350, 640))  # loss, kl, clip_fraction, entropy: 3 columns x 2 rows


def _lines(fig) -> dict:
    return {line.get_label(): line for line in fig.axes[0].get_lines()}


def test_reward_and_accuracy_figures_plot_the_series():
    rows = _synthetic_rows()
    lines = _lines(rewards_figure(rows))
    assert list(lines) == ["reward_mean", "reward/accuracy", "reward/format"]
    assert list(lines["reward/accuracy"].get_ydata()) == pytest.approx([0.05 * s for s in range(1, 13)])
    lines = _lines(accuracy_figure(rows))
    assert list(lines) == ["train accuracy", "held-out", "chance"]
    assert list(lines["held-out"].get_xdata()) == [4, 8, 12]
    assert list(lines["held-out"].get_ydata()) == pytest.approx([0.38, 0.46, 0.54])
    assert lines["chance"].get_linestyle() == "--" and set(lines["chance"].get_ydata()) == {0.25}
    assert "chance" not in _lines(accuracy_figure([{"step": 1, "accuracy": 0.5}]))


def test_step_time_figure_stacks_phases():
    rows = [
        {"step": 1, "time/rollout": 1.0, "time/actor": 0.5, "time/step": 2.0},
        {"step": 2, "time/rollout": 2.0, "time/actor": 0.25, "time/step": 2.25},
    ]
    bars, means = step_time_figure(rows).axes
    rects = [v for r in bars.patches for v in (r.get_x() + r.get_width() / 2, r.get_y(), r.get_height())]
    # rollout at the bottom, actor on top of it, then "other" = 0.5 s only in step 1
    expected = [(1, 0, 1.0), (2, 0, 2.0), (1, 1.0, 0.5), (2, 2.0, 0.25), (1, 1.5, 0.5), (2, 2.25, 0)]
    assert rects == pytest.approx([v for rect in expected for v in rect])
    assert [r.get_width() for r in means.patches] == pytest.approx([1.5, 0.375, 0.25])
    assert [t.get_text() for t in means.get_yticklabels()] == ["rollout", "actor", "other"]


def test_missing_keys_are_skipped(tmp_path):
    _write(tmp_path, [{"step": s, "reward_mean": 0.1 * s} for s in range(1, 4)])
    paths = make_report(tmp_path)
    assert paths == [tmp_path / "report" / "rewards.png"]
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["rewards.png"]
    _assert_png(paths[0], (800, 450))


def test_only_held_out_accuracy_still_plots(tmp_path):
    _write(
        tmp_path,
        [{"step": 5, "val_accuracy": 0.4}, {"step": 10, "val_accuracy": 0.6, "chance_accuracy": 0.5}],
    )
    assert make_report(tmp_path) == [tmp_path / "report" / "accuracy.png"]


def test_missing_or_empty_metrics_raise(tmp_path):
    with pytest.raises(ValueError, match=r"metrics\.jsonl"):
        make_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"metrics\.jsonl.*empty"):
        make_report(tmp_path)


def test_timeline_from_trace(tmp_path):
    """A run's trace.json becomes report/timeline.png (one row per stream)."""
    from rollplex.observe.metrics import Span, write_chrome_trace
    from rollplex.observe.report import make_report, timeline_figure

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5, "time/actor": 1.0}\n')
    spans = [
        Span(0.0, 1.0, "rollout", "decode"),
        Span(0.1, 0.6, "prefix", "prefix"),
        Span(1.0, 2.0, "actor", "main"),
    ]
    write_chrome_trace(spans, tmp_path / "trace.json")
    paths = make_report(tmp_path)
    assert tmp_path / "report" / "timeline.png" in paths
    fig = timeline_figure(__import__("json").loads((tmp_path / "trace.json").read_text()))
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["decode", "prefix", "main"]
    window = timeline_figure(
        __import__("json").loads((tmp_path / "trace.json").read_text()), last_seconds=1.5
    )
    assert window.axes[0].get_xlim() == (0.5, 2.0)  # the window, even though rollout began before it
    assert fig.axes[0].get_xlim() == (0.0, 2.0)  # a trace shorter than the window: from its start
    assert not fig.axes[0].lines and fig.axes[0].get_xlabel() == "seconds since the run started"


def test_the_timeline_marks_where_a_resumed_run_continues(tmp_path):
    from rollplex.observe.metrics import Span, chrome_trace
    from rollplex.observe.report import timeline_figure

    first = chrome_trace([Span(0.0, 1.0, "rollout", "main"), Span(1.0, 2.0, "actor", "main")])
    trace = chrome_trace([Span(7.0, 8.0, "rollout", "main")], base=first)
    ax = timeline_figure(trace).axes[0]
    assert [line.get_xdata()[0] for line in ax.lines] == [2.0]  # at the earlier trace's end
    assert ax.get_xlabel() == "seconds of training (resumed runs joined end to end)"
    assert not timeline_figure(trace, last_seconds=0.5).axes[0].lines  # the mark is outside the window


def test_overlapped_phase1_is_counted_once():
    """An overlapped step's rollout and prefix spans are replaced by the Phase-1 makespan."""
    rows = [
        {
            "step": 1,
            "time/rollout": 2.0,
            "time/prefix": 1.5,
            "time/actor": 1.0,
            "time/step": 3.5,
            "eq1/phase1": 2.2,
            "schedule/overlap": 1,
        },
        {
            "step": 2,
            "time/rollout": 2.0,
            "time/prefix": 1.5,
            "time/actor": 1.0,
            "time/step": 4.5,
            "eq1/phase1": 3.5,
            "schedule/overlap": 0,
        },
    ]
    steps, table = step_times(rows)
    other = table.pop("other")
    assert other == pytest.approx([0.3, 0.0])
    assert table == {"actor": [1.0, 1.0], "phase1": [2.2, 0.0], "rollout": [0.0, 2.0], "prefix": [0.0, 1.5]}


def test_eq1_and_schedule_bench_figures(tmp_path):
    rows = [
        {"step": s, "eq1/T_D": 2.0, "eq1/T_P": 1.0, "eq1/delta_D": 0.2, "eq1/S": 0.8, "eq1/bound": 1.0}
        for s in (1, 2, 3)
    ]
    lines = _lines(eq1_figure(rows))
    assert set(lines) >= {"T_D (decode alone)", "S (measured saving)", "decode as run (T_D + ΔD)"}
    assert list(lines["decode as run (T_D + ΔD)"].get_ydata()) == [2.2, 2.2, 2.2]
    assert eq1_figure([{"step": 1, "eq1/T_D": 2.0}]) is None  # serial: no prefix timed apart
    result = {
        "rows": {
            "serial": {"step_s_median": 10.0, "eq1/T_post": 6.0, "speedup_vs_serial": 1.0},
            "both": {"step_s_median": 8.0, "eq1/T_post": 6.0, "speedup_vs_serial": 1.25},
            "broken": {"error": "out of memory"},
        }
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(result))
    png = bench_report(path)
    assert png == tmp_path / "bench.png"
    _assert_png(png, (900, 260))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a rollplex bench schedule result"):
        bench_report(tmp_path / "bad.json")


def test_a_bench_bar_says_whether_the_update_was_the_baselines():
    from rollplex.observe.report import bar_label

    assert bar_label({"step_s_median": 10.0}) == " 10.00 s"
    same = {"step_s_median": 8.0, "speedup_vs_serial": 1.25, "optimizer_tensors_differing": 0}
    assert bar_label(same) == " 8.00 s (1.250×); same update"
    assert bar_label({**same, "optimizer_tensors_differing": 2472}).endswith(
        "; update differs (2472 tensors)"
    )


def test_a_phase_has_one_colour_in_every_figure():
    """The step-time bars and the timeline draw a phase in the same colour, whatever phases are present."""
    from matplotlib.colors import to_rgba

    from rollplex.observe.report import PHASES, phase_colour, step_time_figure, timeline_figure

    assert len({phase_colour(name) for name in PHASES}) == len(PHASES)
    greys = {phase_colour("evaluation"), phase_colour("checkpoint")}
    assert len(greys) == 2 and not greys & {phase_colour(name) for name in PHASES}
    rows = [{"step": 1, "time/data": 0.1, "time/actor": 2.0}]
    bars = step_time_figure(rows).axes[0]
    bar_colours = {c.get_label(): c.patches[0].get_facecolor() for c in bars.containers}
    trace = {
        "traceEvents": [
            {"ph": "M", "tid": 0, "args": {"name": "main"}},
            {"ph": "X", "tid": 0, "name": "actor", "ts": 0, "dur": 2e6},
            {"ph": "X", "tid": 0, "name": "rollout", "ts": 2e6, "dur": 1e6},
        ]
    }
    spans = timeline_figure(trace).axes[0].collections
    span_colours = [tuple(c.get_facecolor()[0]) for c in spans]
    assert bar_colours["actor"] == to_rgba(phase_colour("actor")) == span_colours[0]
    assert span_colours[1] == to_rgba(phase_colour("rollout")) != span_colours[0]


def _panels(rows) -> dict:
    return {ax.get_title(): ax for ax in diagnostics_figure(rows).axes}


def _by_gid(artists, gid: str) -> list:
    return [a for a in artists if a.get_gid() == gid]


def test_every_training_panel_names_its_quantity_and_unit():
    panels = _panels(_synthetic_rows())
    assert len(panels) == 5  # loss, kl, clip_fraction, entropy, step time
    for title, ax in panels.items():
        assert ax.get_xlabel() == "step", title
        assert ax.get_ylabel(), title
    by_key = {panel.key: panel for panel in DIAGNOSTICS}
    assert panels[by_key["kl"].title].get_ylabel() == "KL (nats per token)"
    assert panels[by_key["time/step"].title].get_ylabel() == "seconds per step"
    assert all(panel.ylabel and panel.title for panel in DIAGNOSTICS)


def test_loss_and_kl_panels_draw_a_zero_line():
    panels = _panels(_synthetic_rows())
    titles = {panel.key: panel.title for panel in DIAGNOSTICS}
    for key in ("loss", "kl"):
        (zero,) = _by_gid(panels[titles[key]].get_lines(), "zero")
        assert set(zero.get_ydata()) == {0.0}
        low, high = panels[titles[key]].get_ylim()
        assert low <= 0.0 <= high  # in view, although every loss here is above 0.08
    for key in ("clip_fraction", "entropy", "time/step"):
        assert not _by_gid(panels[titles[key]].get_lines(), "zero"), key


def test_a_flat_series_has_its_value_written_and_a_varying_one_not():
    panels = _panels(_synthetic_rows())
    titles = {panel.key: panel.title for panel in DIAGNOSTICS}
    (entropy,) = _by_gid(panels[titles["entropy"]].texts, "flat")
    assert entropy.get_text() == "2 nats/token throughout"
    (clipped,) = _by_gid(panels[titles["clip_fraction"]].texts, "flat")
    assert clipped.get_text() == "0 throughout"
    assert not _by_gid(panels[titles["loss"]].texts, "flat")
    assert not _by_gid(panels[titles["kl"]].texts, "flat")


def test_the_step_time_panel_shows_its_median():
    rows = [{"step": s, "time/step": t} for s, t in enumerate([1.0, 9.0, 2.0, 3.0, 2.5], start=1)]
    (ax,) = diagnostics_figure(rows).axes
    (line,) = _by_gid(ax.get_lines(), "median")
    assert set(line.get_ydata()) == {2.5}
    (label,) = _by_gid(ax.texts, "median")
    assert label.get_text() == "median 2.5 s"
    assert not _by_gid(ax.texts, "flat")

"""PNG report of a run from its ``metrics.jsonl``.

Figures written to ``run_dir/report/`` (a figure whose keys are all missing is not written):

- ``rewards.png``: ``reward_mean`` and each ``reward/<fn>`` vs step.
- ``accuracy.png``: training ``accuracy`` and held-out ``val_accuracy`` vs step, ``chance_accuracy`` dashed
  (with T-GRPO also ``temporal/ordered_accuracy`` and ``temporal/shuffled_accuracy``, dotted).
- ``step_time.png``: stacked bars of the ``time/<phase>`` seconds of every step (plus ``other`` =
  ``time/step`` minus the phases, when positive), and the mean breakdown over steps. On steps whose
  Phase-1 prefixes overlapped decode, ``rollout`` and ``prefix`` are replaced by the Phase-1 makespan
  (``phase1``), so the bars never count overlapped time twice.
- ``eq1.png``: the paper's Eq. 1 terms per step (``eq1/*``: T_D, T_P, decode as run = T_D + ΔD,
  saving S and the bound min(T_D, T_P); schedule.critical_path defines them).
- ``training.png``: one panel per diagnostic present (``DIAGNOSTICS``: loss, kl, clip_fraction, entropy,
  step time, ...), each with its quantity and unit on the y axis; loss and KL with a line at 0, the step
  time with its median, and a flat series with its value written in the panel.

Matplotlib is used through ``Figure`` objects and its Agg canvas, without pyplot's global state.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from rollplex.observe.metrics import TRACE_FILE, read_metrics

REPORT_DIR = "report"


@dataclass(frozen=True)
class Panel:
    """One panel of ``training.png``: the ``metrics.jsonl`` key it draws, its title (what the quantity
    is, and where it helps, what a healthy run shows), its y-axis label (quantity and unit), the unit
    written after a value in the panel, whether it draws a line at 0 (``zero_line``: quantities read by
    their sign or their distance from 0) and its median (``median``: a line and its value)."""

    key: str
    title: str
    ylabel: str
    unit: str = ""
    zero_line: bool = False
    median: bool = False

    def value_text(self, value: float) -> str:
        return f"{value:.3g} {self.unit}".rstrip()


DIAGNOSTICS = (
    Panel("loss", "Policy loss (surrogate + KL term)", "loss (no unit)", zero_line=True),
    Panel("kl", "KL to the reference (0 at the start)", "KL (nats per token)", "nats/token", zero_line=True),
    Panel("clip_fraction", "Tokens clipped by the PPO ratio", "fraction of tokens"),
    Panel("entropy", "Policy entropy", "entropy (nats per token)", "nats/token"),
    Panel("time/step", "Step time", "seconds per step", "s", median=True),
    Panel("response_length", "Response length", "tokens (mean per response)", "tokens"),
    Panel("format_rate", "Responses in the answer format", "fraction of responses"),
    Panel("grad_norm", "Gradient norm before clipping", "L2 norm"),
    Panel("zero_variance_groups", "Groups with equal rewards (no signal)", "groups per step"),
    Panel("skipped_samples", "Samples skipped so far (0: all usable)", "samples"),
    Panel("peak_memory_gib", "Peak device memory in the step", "GiB", "GiB"),
    Panel("memory_allocated_gib", "Allocated after the step (flat: no leak)", "GiB", "GiB"),
    Panel("gc_s", "Garbage collector in the step", "seconds", "s"),
    Panel("lr", "Learning rate", "learning rate"),
    Panel(
        "logprob_diff_max", "Rollout vs trainer log-prob (0: they agree)", "max |difference| (nats)", "nats"
    ),
)


def series(rows: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the rows where ``key`` is present and not None, in row order."""
    pairs = [(row["step"], float(row[key])) for row in rows if row.get(key) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def keys_with_prefix(rows: Sequence[dict], prefix: str, exclude: Sequence[str] = ()) -> list[str]:
    """Keys starting with ``prefix`` in first-seen order, without ``exclude``."""
    seen: dict[str, None] = {}
    for row in rows:
        seen.update({k: None for k in row if k.startswith(prefix) and k not in exclude})
    return list(seen)


def step_times(rows: Sequence[dict]) -> tuple[list[int], dict[str, list[float]]]:
    """Per-step seconds of each phase (0 where a phase is absent) over the rows with any ``time/`` key.

    Returns ``(steps, {phase: [seconds per step]})``; the phase ``"other"`` = max(0, ``time/step`` − Σ phases)
    is added when ``time/step`` is present and the residual is positive somewhere.
    """
    timed = [_phase1_merged(row) for row in rows if any(k.startswith("time/") for k in row)]
    phases = keys_with_prefix(timed, "time/", exclude=("time/step",))
    table = {p.removeprefix("time/"): [float(row.get(p) or 0.0) for row in timed] for p in phases}
    totals = [sum(values) for values in zip(*table.values(), strict=True)] if table else [0.0] * len(timed)
    other = [max(0.0, float(row.get("time/step") or 0.0) - t) for row, t in zip(timed, totals, strict=True)]
    if any(other):
        table["other"] = other
    return [row["step"] for row in timed], table


def _phase1_merged(row: dict) -> dict:
    """The row with overlapped ``time/rollout`` and ``time/prefix`` replaced by ``time/phase1``."""
    if not row.get("schedule/overlap"):
        return row
    merged = {k: v for k, v in row.items() if k not in ("time/rollout", "time/prefix")}
    return {**merged, "time/phase1": row.get("eq1/phase1")}


EQ1_LINES = (
    ("eq1/T_D", "T_D (decode alone)"),
    ("eq1/T_P", "T_P (prefixes alone)"),
    ("eq1/decode_as_run", "decode as run (T_D + ΔD)"),
    ("eq1/S", "S (measured saving)"),
    ("eq1/bound", "bound min(T_D, T_P)"),
)


def eq1_figure(rows: Sequence[dict]) -> Figure | None:
    """Eq. 1 terms per step (8×4 in); None without ``eq1/T_P`` (serial runs time no prefix apart)."""
    if not series(rows, "eq1/T_P")[0]:
        return None
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    rows = [
        {**row, "eq1/decode_as_run": row["eq1/T_D"] + row["eq1/delta_D"]}
        if row.get("eq1/T_D") is not None and row.get("eq1/delta_D") is not None
        else row
        for row in rows
    ]
    for key, label in EQ1_LINES:
        steps, values = series(rows, key)
        if steps:
            ax.plot(steps, values, marker="o", label=label)
    _step_axis(ax, ylabel="seconds", title="Critical path, paper Eq. 1")
    ax.legend(fontsize="small")
    return fig


def schedule_bench_figure(result: dict) -> Figure:
    """``rollplex bench schedule`` JSON as horizontal bars per schedule: Phase-1 makespan and the rest of
    the step (T_post), with the speedup over the row's baseline written at the end of each bar, and
    whether its update was the baseline's (``bar_label``) (9×(1+0.5·rows) in)."""
    rows = {name: row for name, row in result["rows"].items() if "error" not in row}
    names = list(rows)
    fig = Figure(figsize=(9, 1.6 + 0.5 * len(names)))
    ax = fig.add_subplot()
    step = [rows[n]["step_s_median"] for n in names]
    post = [rows[n].get("eq1/T_post") or 0.0 for n in names]
    first = [max(0.0, s - p) for s, p in zip(step, post, strict=True)]
    ax.barh(names, first, label="rollout (+ Phase-1 prefixes)")
    ax.barh(names, post, left=first, label="rewards, suffixes, backward, optimizer")
    for i, name in enumerate(names):
        ax.text(step[i], i, bar_label(rows[name]), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="median seconds per step", title="Schedules side by side")
    compared = any("optimizer_tensors_differing" in rows[n] for n in names)  # longer labels
    ax.set_xlim(0, max(step, default=1.0) * (1.8 if compared else 1.3))
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2)
    return fig


def bar_label(row: dict) -> str:
    """A bench row's bar label: step time, speedup over its baseline, and, where the optimizer's
    tensors were compared with the baseline's, whether the update was the same (bitwise) or differed
    (in how many tensors)."""
    label = f" {row['step_s_median']:.2f} s"
    if row.get("speedup_vs_serial"):
        label += f" ({row['speedup_vs_serial']:.3f}×)"
    differing = row.get("optimizer_tensors_differing")
    if differing is not None:
        label += "; same update" if differing == 0 else f"; update differs ({differing} tensors)"
    return label


def mean_breakdown(table: dict[str, list[float]]) -> dict[str, float]:
    """Mean seconds per step of each phase of a ``step_times`` table."""
    return {name: sum(values) / len(values) for name, values in table.items() if values}


def _step_axis(ax, **labels: str) -> None:
    """x axis = optimizer step (integer ticks), light grid, and the given ``ax.set`` labels."""
    ax.set(xlabel="step", **labels)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def rewards_figure(rows: Sequence[dict]) -> Figure | None:
    """``reward_mean`` and each ``reward/<fn>`` vs step (8×4.5 in); None when none is present."""
    keys = [k for k in ["reward_mean", *keys_with_prefix(rows, "reward/")] if series(rows, k)[0]]
    # A single unweighted reward function equals the mean: draw it once.
    keys = [k for k in keys if k == "reward_mean" or series(rows, k) != series(rows, "reward_mean")]
    if not keys:
        return None
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    for key in keys:
        ax.plot(*series(rows, key), label=key, linewidth=2.0 if key == "reward_mean" else 1.2)
    _step_axis(ax, ylabel="reward (mean over responses)", title="Rewards")
    ax.legend()
    return fig


def accuracy_figure(rows: Sequence[dict]) -> Figure | None:
    """Train and held-out accuracy vs step, chance dashed, and with T-GRPO the video groups' compared
    reward (``reward.temporal_reward``, by default the accuracy) on ordered and on shuffled frames,
    dotted (8×4.5 in); None without either accuracy."""
    if not (series(rows, "accuracy")[0] or series(rows, "val_accuracy")[0]):
        return None
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    styles = (
        ("accuracy", {"label": "train accuracy"}),
        ("val_accuracy", {"label": "held-out", "marker": "o"}),
        ("temporal/ordered_accuracy", {"label": "T-GRPO compared reward, ordered frames", "linestyle": ":"}),
        (
            "temporal/shuffled_accuracy",
            {"label": "T-GRPO compared reward, shuffled frames", "linestyle": ":"},
        ),
    )
    for key, style in styles:
        if series(rows, key)[0]:
            ax.plot(*series(rows, key), **style)
    if series(rows, "chance_accuracy")[0]:
        ax.plot(*series(rows, "chance_accuracy"), linestyle="--", color="gray", label="chance")
    _step_axis(ax, ylabel="accuracy", title="Accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    return fig


PHASES = (
    "data",
    "rollout",
    "prefix",
    "rewards",
    "reference",
    "actor",
    "optimizer",
    "phase1",
    "other",
    "temporal",
)
BETWEEN_STEPS = {"evaluation": "0.75", "checkpoint": "0.45"}  # greys: the trace's work between steps


def phase_colour(name: str) -> str:
    """One colour per phase name in every figure (matplotlib's C0–C9 cycle in ``PHASES`` order; other
    names after them; greys for ``BETWEEN_STEPS``)."""
    if name in BETWEEN_STEPS:
        return BETWEEN_STEPS[name]
    index = PHASES.index(name) if name in PHASES else len(PHASES) + sum(map(ord, name))
    return f"C{index % 10}"


def step_time_figure(rows: Sequence[dict]) -> Figure | None:
    """Stacked per-step phase seconds and the mean breakdown (12×4.5 in); None without ``time/`` keys."""
    steps, table = step_times(rows)
    if not table:
        return None
    fig = Figure(figsize=(12, 4.5))
    bars, means = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    bottom = [0.0] * len(steps)
    for name, values in table.items():
        bars.bar(steps, values, bottom=bottom, label=name, width=0.8, color=phase_colour(name))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    _step_axis(bars, ylabel="seconds", title="Step time by phase")
    bars.legend(fontsize="small")
    breakdown = mean_breakdown(table)
    total = sum(breakdown.values()) or 1.0
    names = list(breakdown)
    means.barh(names, [breakdown[n] for n in names], color=[phase_colour(n) for n in names])
    for i, name in enumerate(names):
        means.text(
            breakdown[name],
            i,
            f" {breakdown[name]:.2f} s ({100 * breakdown[name] / total:.0f} %)",
            va="center",
        )
    means.invert_yaxis()
    means.set(xlabel="mean seconds per step", title=f"Mean breakdown ({total:.2f} s/step)")
    means.set_xlim(0, max(breakdown.values(), default=1.0) * 1.4 or 1.0)
    return fig


def diagnostics_figure(rows: Sequence[dict]) -> Figure | None:
    """One panel per present ``DIAGNOSTICS`` key, 3 columns (4.5×3.2 in each); None when none is present.
    Every panel names its quantity and unit on the y axis; a flat series (one value throughout) has the
    value written in the panel (``gid`` ``flat``), since its axis then only brackets it."""
    present = [panel for panel in DIAGNOSTICS if series(rows, panel.key)[0]]
    if not present:
        return None
    cols = min(3, len(present))
    nrows = -(-len(present) // cols)
    fig = Figure(figsize=(4.5 * cols, 3.2 * nrows))
    for i, panel in enumerate(present):
        ax = fig.add_subplot(nrows, cols, i + 1)
        _draw_panel(ax, panel, *series(rows, panel.key))
    return fig


def _draw_panel(ax, panel: Panel, steps: list[int], values: list[float]) -> None:
    ax.plot(steps, values)
    _step_axis(ax, title=panel.title, ylabel=panel.ylabel)
    ax.ticklabel_format(axis="y", useOffset=False)  # a near-flat series keeps its own numbers on the axis
    if panel.zero_line:
        ax.axhline(0.0, color="black", linewidth=0.8, gid="zero")
    if panel.median:
        middle = statistics.median(values)
        ax.axhline(middle, color="gray", linestyle="--", linewidth=1, gid="median")
        ax.annotate(
            f"median {panel.value_text(middle)}",
            (0.98, middle),
            xycoords=("axes fraction", "data"),
            ha="right",
            va="bottom",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
            gid="median",
        )
    if min(values) == max(values):
        ax.text(
            0.5,
            0.6,
            f"{panel.value_text(values[0])} throughout",
            transform=ax.transAxes,
            ha="center",
            fontsize=9,
            bbox={"facecolor": "white", "edgecolor": "0.7"},
            gid="flat",
        )


def timeline_figure(trace: dict, last_seconds: float = 30.0) -> Figure | None:
    """Gantt chart of the trace's last ``last_seconds``: one row per stream (main, decode, prefix), one
    bar per phase span, coloured by phase name, and a dashed line where a resumed run continues the
    trace. None for an empty trace."""
    names = {
        e["tid"]: e["args"]["name"]
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    spans = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    if not spans:
        return None
    end = max(e["ts"] + e["dur"] for e in spans) / 1e6
    shown = [e for e in spans if (e["ts"] + e["dur"]) / 1e6 >= end - last_seconds]
    phases = sorted({e["name"] for e in shown})
    colours = {name: phase_colour(name) for name in phases}
    rows = sorted({e["tid"] for e in shown})
    fig = Figure(figsize=(10, 1.2 + 0.6 * len(rows)))
    ax = fig.add_subplot()
    for row, tid in enumerate(rows):
        for e in (e for e in shown if e["tid"] == tid):
            ax.broken_barh([(e["ts"] / 1e6, e["dur"] / 1e6)], (row - 0.4, 0.8), color=colours[e["name"]])
    ax.set_yticks(range(len(rows)), [names.get(tid, str(tid)) for tid in rows])
    start = max(end - last_seconds, min(e["ts"] for e in spans) / 1e6)
    ax.set_xlim(start, end)  # a span that began before the window is drawn from the window's start
    resumes = [
        e["ts"] / 1e6 for e in trace["traceEvents"] if e.get("ph") == "i" and e.get("name") == "resumed"
    ]
    for at in (t for t in resumes if start <= t <= end):
        ax.axvline(at, color="black", linestyle="--", linewidth=1)
        ax.annotate("resumed", (at, len(rows) - 0.5), fontsize=8, ha="left", va="bottom")
    ax.set_xlabel(
        "seconds of training (resumed runs joined end to end)" if resumes else "seconds since the run started"
    )
    ax.set_title(f"Step timeline (last {last_seconds:.0f} s)")
    handles = [Rectangle((0, 0), 1, 1, color=colours[n]) for n in phases]
    ax.legend(handles, phases, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def memory_figure(trace: dict, rows: Sequence[dict]) -> Figure | None:
    """The memory on the device over the last step (as the paper's Fig. 8): the trace's ``device GiB``
    counter samples (one as each window of the step starts: rollout, scoring, backward, update), stacked
    by state class, with the plan's predicted peak and the measured peak of that step (metrics.jsonl)
    as lines. None where the trace has no memory counters."""
    events = trace.get("traceEvents", [])
    spans = [e for e in events if e.get("ph") == "X" and isinstance(e.get("args"), dict)]
    samples = [e for e in events if e.get("ph") == "C" and e.get("name") == "device GiB"]
    if not spans or not samples:
        return None
    last = max(e["args"].get("step", 0) for e in spans)
    start = min(e["ts"] for e in spans if e["args"].get("step") == last)
    end = max(e["ts"] + e["dur"] for e in spans if e["args"].get("step") == last)
    step = [e for e in samples if start - 1 <= e["ts"] <= end]
    if not step:
        return None
    classes = sorted(
        {k for e in step for k in e["args"]}, key=lambda k: -max(e["args"].get(k, 0) for e in step)
    )
    times = [(e["ts"] - start) / 1e6 for e in step] + [(end - start) / 1e6]
    values = [[e["args"].get(k, 0.0) for e in step] + [step[-1]["args"].get(k, 0.0)] for k in classes]
    fig = Figure(figsize=(10, 4.5))
    ax = fig.add_subplot()
    ax.stackplot(times, *values, labels=classes, step="post", alpha=0.85)
    row = next((r for r in reversed(rows) if r.get("step") == last and "peak_memory_gib" in r), None)
    for key, label, style in (
        ("memory/predicted_peak_gib", "planned peak", "--"),
        ("peak_memory_gib", "measured peak", "-"),
    ):
        if row is not None and key in row:
            ax.axhline(row[key], color="black", linestyle=style, linewidth=1)
            ax.annotate(f"{label} {row[key]:.1f} GiB", (0, row[key]), fontsize=8, va="bottom")
    ax.set_xlabel(
        f"seconds into step {last} (a sample as each window starts: rollout, scoring, backward, update)"
    )
    ax.set_ylabel("device memory, GiB")
    ax.set_title(
        "What lives on the device in each window, by state class (other: activations, KV, workspaces)"
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def bench_report(path: Path) -> Path:
    """Draw a ``rollplex bench schedule`` JSON file as a PNG beside it (same name, ``.png``).

    Raises ``ValueError`` naming the path when it is not such a file.
    """
    try:
        result = json.loads(Path(path).read_text())
        figure = schedule_bench_figure(result)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a rollplex bench schedule result ({err})") from err
    out = Path(path).with_suffix(".png")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    return out


def make_report(run_dir: Path) -> list[Path]:
    """Write the report PNGs of ``run_dir`` into ``run_dir/report/`` and return their paths.

    Raises ``ValueError`` naming the path when ``run_dir/metrics.jsonl`` is missing or empty.
    """
    rows = read_metrics(run_dir)
    out = Path(run_dir) / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    plots = (
        (rewards_figure, "rewards.png"),
        (accuracy_figure, "accuracy.png"),
        (step_time_figure, "step_time.png"),
        (eq1_figure, "eq1.png"),
        (diagnostics_figure, "training.png"),
    )
    figures = [(build(rows), name) for build, name in plots]
    trace = Path(run_dir) / TRACE_FILE
    if trace.exists():
        events = json.loads(trace.read_text())
        figures.append((timeline_figure(events), "timeline.png"))
        figures.append((memory_figure(events, rows), "memory.png"))
    written = []
    for fig, name in figures:
        if fig is not None:
            fig.tight_layout()
            fig.savefig(out / name, dpi=100)
            written.append(out / name)
    return written

"""Whether the device waits for the host's launches in a serial GRPO step of the ``rollplex bench
schedule`` workload, layer by layer: after two warm-up steps, one step with a probe at the start of every
decoder layer and vision block forward (prefix and suffix passes, and activation checkpointing's
recomputation) of the actor and the reference, and at every actor layer's gradient (its MLP down
weight's accumulation, in backward).

Each probe notes the host clock and records a CUDA event on the current stream. The device reaches the
probe ``lag`` seconds after the host issued it (event time on the device's clock, aligned to the host's
by an event recorded just after a synchronisation at the start of the step). A lag near zero means
the device ran out of queued work there and waited for the host; a lag of milliseconds means work was
queued ahead. Between two probes of one kind at neighbouring layers of one pass, on one thread, the host
interval is the host's time to issue one layer, the CPU interval the issuing thread's CPU time over it,
and the device interval the time between the device reaching the two probes (its work on the layer,
and any wait for the host). Forward probes run on the main thread; recomputation (kind ``recompute``)
and backward (``bwd``) run on autograd's thread, each layer recomputed just before its own backward, so
their intervals cover one layer's recomputation and backward together.

Prints, per phase and probe kind: probes, median lag, share of probes with a lag under 1 ms, the pairs
of neighbouring probes, their summed host, CPU and device intervals, and the medians of the host and
device intervals (per layer); and each phase's host issue time against its wall time, with the main
thread's CPU time while issuing; the step's process CPU time counts every thread. Writes
OUT_PREFIX.lag.txt (the tables), OUT_PREFIX.lag.json (every probe), OUT_PREFIX.lag.png (lag over the
step), and OUT_PREFIX.cprofile.txt (one more step under cProfile, probes off: functions by own time and
by cumulative time).

Usage (CUDA): python benchmarks/scripts/host_lag.py OUT_PREFIX [--row serial|serial-parts|serial-eager]
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from rollplex.bench.common import cprofile_report, cuda_script_args, one_of
from rollplex.bench.schedule import ROWS, default_row
from rollplex.observe.metrics import PhaseTimer

SERIAL_ROWS = tuple(name for name, row in ROWS.items() if row.get("schedule.kind") == "serial")


class _Probes:
    """Host clock, the calling thread's CPU clock and a CUDA event per probe; the phase it falls in and
    the layer's index. A forward probe on another thread than the main one is a recomputation (activation
    checkpointing recomputes a layer on autograd's thread, just before that layer's backward)."""

    def __init__(self) -> None:
        self.phase = "-"
        self.rows: list[tuple[str, str, int, float, float, int, torch.cuda.Event]] = []
        self.on = False
        self.main = threading.get_ident()

    def __call__(self, kind: str, index: int) -> None:
        if not self.on:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        now = (time.perf_counter(), time.thread_time(), threading.get_ident())
        if now[2] != self.main and kind.endswith(":fwd"):
            kind = kind[: -len("fwd")] + "recompute"
        self.rows.append((self.phase, kind, index, *now, event))


class _IssueTimer(PhaseTimer):
    """A PhaseTimer that also notes, per phase, when the host finished issuing it (before the sync)."""

    def __init__(self, probes: _Probes) -> None:
        super().__init__(sync=torch.cuda.synchronize)
        self.probes = probes
        self.issue: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str, stream: str = "main"):
        start = self.now()
        cpu = time.thread_time()
        self.probes.phase = name
        try:
            yield
        finally:
            issued, cpu = time.perf_counter(), time.thread_time() - cpu
            end = self.now()
            self.cpu[name] += cpu
            self.issue[name] += issued - start
            self.wall[name] += end - start
            self.record(name, start, end, stream)
            self.probes.phase = "-"


def _install(roles, probes: _Probes) -> None:
    models = [("actor", roles.actor)] + ([("ref", roles.reference)] if roles.reference is not None else [])
    for role, model in models:
        for part, layers in (
            ("text", model.model.language_model.layers),
            ("vision", model.model.visual.blocks),
        ):
            kind = f"{role}:{part}:fwd"
            for i, layer in enumerate(layers):
                layer.register_forward_pre_hook(lambda *_a, _k=kind, _i=i: probes(_k, _i))
            if role == "actor":
                kind_b = f"actor:{part}:bwd"
                for i, layer in enumerate(layers):
                    weight = layer.mlp.down_proj.weight
                    if weight.requires_grad:
                        weight.register_post_accumulate_grad_hook(lambda _p, _k=kind_b, _i=i: probes(_k, _i))


def _table(probes: _Probes, anchor_host: float, anchor: torch.cuda.Event) -> tuple[str, list[dict]]:
    rows = [
        {
            "phase": phase,
            "kind": kind,
            "layer": index,
            "host_s": host - anchor_host,
            "cpu_s": cpu,
            "thread": thread,
            "device_s": anchor.elapsed_time(event) / 1000.0,
        }
        for phase, kind, index, host, cpu, thread, event in probes.rows
    ]
    for r in rows:
        r["lag_ms"] = (r["device_s"] - r["host_s"]) * 1000.0
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["phase"], r["kind"])].append(r)
    lines = [
        f"{'phase':10s} {'kind':24s} {'probes':>6s} {'median lag ms':>13s} {'lag<1ms':>8s} {'pairs':>6s} "
        f"{'host s':>8s} {'cpu s':>8s} {'device s':>8s} {'median host ms':>14s} {'median device ms':>16s}"
    ]
    for (phase, kind), rs in groups.items():
        lags = [r["lag_ms"] for r in rs]
        pairs = _pairs(rs)
        host, cpu, dev = (sum(b[k] - a[k] for a, b in pairs) for k in ("host_s", "cpu_s", "device_s"))
        per_host, per_dev = (
            statistics.median([(b[k] - a[k]) * 1000.0 for a, b in pairs]) if pairs else float("nan")
            for k in ("host_s", "device_s")
        )
        lines.append(
            f"{phase:10s} {kind:24s} {len(rs):6d} {statistics.median(lags):13.2f} "
            f"{sum(lag < 1.0 for lag in lags) / len(lags):8.2f} {len(pairs):6d} {host:8.3f} {cpu:8.3f} "
            f"{dev:8.3f} {per_host:14.2f} {per_dev:16.2f}"
        )
    return "\n".join(lines), rows


def _pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """Consecutive probes of one pass: on one thread, at neighbouring layers (forward: the next layer;
    recomputation and backward: the previous one, as backward goes from the last layer to the first)."""
    return [
        (a, b)
        for a, b in zip(rows, rows[1:])
        if a["thread"] == b["thread"] and abs(b["layer"] - a["layer"]) == 1
    ]


def _plot(rows: list[dict], path: str, row: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    kinds = sorted({r["kind"] for r in rows})
    for kind in kinds:
        rs = [r for r in rows if r["kind"] == kind]
        ax.scatter([r["host_s"] for r in rs], [max(r["lag_ms"], 0.01) for r in rs], s=3, label=kind)
    ax.set_yscale("log")
    ax.set_xlabel("host time in the step (s)")
    ax.set_ylabel("device lag behind the host (ms)")
    ax.set_title(f"Probes of one GRPO step of row {row}: near 0 = the device waits for the host")
    ax.legend(markerscale=4, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(out: str, row: str = "serial") -> None:
    work, roles, step = default_row(row, torch.device("cuda"))
    probes = _Probes()
    timer = _IssueTimer(probes)
    _install(roles, probes)
    for i in range(2):
        start = timer.now()
        step(roles, work.prompts, timer)
        print(f"warm-up {i}", round(timer.now() - start, 3), "s", flush=True)
    for totals in (timer.issue, timer.wall, timer.cpu):
        totals.clear()
    torch.cuda.synchronize()
    anchor = torch.cuda.Event(enable_timing=True)
    anchor.record()
    anchor_host = time.perf_counter()
    probes.on = True
    cpu0, process0, start = time.thread_time(), time.process_time(), time.perf_counter()
    step(roles, work.prompts, timer)
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu0
    process = time.process_time() - process0
    probes.on = False
    text, rows = _table(probes, anchor_host, anchor)
    phases = "\n".join(
        f"{name:10s} issued {timer.issue[name]:7.3f} s  wall {timer.wall[name]:7.3f} s  "
        f"main thread CPU while issuing {timer.cpu[name]:7.3f} s"
        for name in timer.wall
    )
    report = (
        f"{row}: probed step: wall {wall:.3f} s, main thread CPU {cpu:.3f} s, process CPU {process:.3f} s\n"
        f"{phases}\n{text}"
    )
    print(report, flush=True)
    with open(out + ".lag.txt", "w") as f:
        f.write(report + "\n")
    with open(out + ".lag.json", "w") as f:
        json.dump(rows, f)
    _plot(rows, out + ".lag.png", row)
    cprofile_report(lambda: step(roles, work.prompts, timer), out + ".cprofile.txt", 60, 90)


if __name__ == "__main__":
    args = cuda_script_args(
        __doc__,
        lambda p: (
            p.add_argument(
                "out_prefix",
                metavar="OUT_PREFIX",
                help="write OUT_PREFIX.lag.txt/.json/.png and OUT_PREFIX.cprofile.txt",
            ),
            p.add_argument(
                "--row",
                default="serial",
                type=one_of(SERIAL_ROWS),
                help=f"the benchmark row to probe: {', '.join(SERIAL_ROWS)} (default serial)",
            ),
        ),
    )
    main(args.out_prefix, args.row)

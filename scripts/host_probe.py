"""Where the host spends a serial GRPO step of the ``rollplex bench schedule`` workload, and where it
waits for the device: after two warm-up steps, one step with CUDA's synchronisation warnings on (each
synchronising call counted by the innermost ``rollplex`` and transformers frames that made it), three
plain steps, then one step under cProfile (functions by own time and by cumulative time). Every step
prints its wall time, its phase times, the
allocator's device allocations and frees, the decode step's construction and capture times, and the
garbage collector's passes and time (``observe.metrics.GcClock``, which freezes the first step's survivors
out of later passes as a training run does).

Usage (CUDA): python scripts/host_probe.py OUT_PREFIX   # writes OUT_PREFIX.syncs.txt, OUT_PREFIX.cprofile.txt
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections import Counter

import torch

from rollplex.bench.common import cprofile_report, cuda_script_out_prefix
from rollplex.bench.schedule import default_row
from rollplex.observe.metrics import GcClock, PhaseTimer


def _where() -> str:
    frames = [
        f for f in traceback.extract_stack()[:-3] if "rollplex" in f.filename or "transformers" in f.filename
    ]
    return " < ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))


def _sync_table(run) -> str:
    seen: Counter[str] = Counter()
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            seen[_where()] += 1
        else:
            show(message, category, filename, lineno, file, line)

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rows = [f"{n:6d}  {where}" for where, n in seen.most_common(40)]
    return f"{sum(seen.values())} synchronising calls\n" + "\n".join(rows)


def _time_decoder_setup() -> dict[str, list[float]]:
    """Wrap the decode step's construction and graph capture with wall-clock timers (device synchronised
    before and after, so each time is that call's own)."""
    from rollplex.rollout import decode

    times: dict[str, list[float]] = {"decoder_init_s": [], "capture_s": []}
    for name, key in (("__init__", "decoder_init_s"), ("capture", "capture_s")):
        original = getattr(decode.StaticDecoder, name)

        def timed(self, *args, _original=original, _key=key, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = _original(self, *args, **kwargs)
            torch.cuda.synchronize()
            times[_key].append(time.perf_counter() - start)
            return out

        setattr(decode.StaticDecoder, name, timed)
    return times


def main(out: str) -> None:
    with GcClock() as gc_clock:  # the collector timed, and tuned, as in a training run
        _probe(out, gc_clock)


def _probe(out: str, gc_clock: GcClock) -> None:
    work, roles, step = default_row("serial", torch.device("cuda"))
    timer = PhaseTimer(sync=torch.cuda.synchronize)

    setup = _time_decoder_setup()

    def run(label: str) -> None:
        gc_clock.pop()
        stats = torch.cuda.memory_stats()
        start = timer.now()
        step(roles, work.prompts, timer)
        torch.cuda.synchronize()
        phases = {k: round(v, 3) for k, v in timer.pop().items() if isinstance(v, float)}
        after = torch.cuda.memory_stats()
        allocs = {
            k: after[k] - stats.get(k, 0)
            for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")
        }
        decoder = {k: [round(t, 3) for t in v] for k, v in setup.items()}
        collected = {k: round(v, 3) for k, v in gc_clock.pop().items()}
        print(label, round(timer.now() - start, 3), "s", phases, allocs, decoder, collected, flush=True)
        gc_clock.step_done()
        for v in setup.values():
            v.clear()

    for i in range(2):
        run(f"warm-up {i}")
    syncs = _sync_table(lambda: run("sync-checked"))
    print(syncs, flush=True)
    with open(out + ".syncs.txt", "w") as f:
        f.write(syncs + "\n")
    for i in range(3):
        run(f"plain {i}")
    text = cprofile_report(lambda: run("cprofiled"), out + ".cprofile.txt", 45, 70)
    print(text[:3000], flush=True)


if __name__ == "__main__":
    main(cuda_script_out_prefix(__doc__, "OUT_PREFIX.syncs.txt and OUT_PREFIX.cprofile.txt"))

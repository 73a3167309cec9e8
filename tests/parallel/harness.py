"""Run a function on N CPU processes at once, as torchrun would on N GPUs: gloo, file:// rendezvous.

A ``RankPool`` spawns N workers once (torch.multiprocessing's spawn start method, one thread each, a
fresh rendezvous file in a temporary folder, short collective timeouts) and keeps them for the session,
since starting a process that imports torch and transformers costs seconds. ``run(fn, *args)`` runs
the top-level function ``fn`` on every rank and returns the ranks' results in rank order. A rank that
raises surfaces in the parent as an ``AssertionError`` naming the rank and carrying its traceback;
ranks that do not answer in time are named too, and the pool is then replaced by a fresh one.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RUN_TIMEOUT_S = 120.0  # one task on every rank, start-up of a fresh pool included
GRACE_S = 5.0  # after one rank failed, how long the others get to report
COLLECTIVE_TIMEOUT = timedelta(seconds=30)


def _worker(rank: int, world: int, rendezvous: str, tasks, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - reported to the parent with the rank
            results.put((rank, False, traceback.format_exc()))


def _ping() -> int:
    """A collective every rank must reach: the pool is usable after a failed task."""
    flag = torch.ones(1)
    dist.all_reduce(flag)
    return int(flag.item())


class RankPool:
    """``world`` spawned worker processes sharing one gloo process group (module docstring)."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world = world
        self.folder = tempfile.mkdtemp(prefix="rollplex-ranks-")
        rendezvous = os.path.join(self.folder, "rendezvous")
        self.tasks = [ctx.SimpleQueue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, rendezvous, self.tasks[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float = RUN_TIMEOUT_S) -> list:
        """``fn(*args)`` on every rank; the results in rank order.

        Raises:
            AssertionError: a rank raised (its rank and traceback in the message), a worker died, or
                a rank did not answer within ``timeout`` seconds.
        """
        for q in self.tasks:
            q.put((fn, args))
        answers, failures = self._collect(timeout)
        if failures or len(answers) < self.world:
            missing = sorted(set(range(self.world)) - set(answers) - set(failures))
            if missing or not self._healthy():
                self.close()
            raise AssertionError(_report(fn, self.world, failures, missing, timeout))
        return [answers[r] for r in range(self.world)]

    def _collect(self, timeout: float) -> tuple[dict, dict]:
        answers, failures = {}, {}
        deadline = time.monotonic() + timeout
        while len(answers) + len(failures) < self.world:
            if failures:
                deadline = min(deadline, time.monotonic() + GRACE_S)
            try:
                rank, ok, value = self.results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in failures]
                for r in dead:
                    failures[r] = f"worker process exited with code {self.procs[r].exitcode}"
                if time.monotonic() >= deadline:
                    break
                continue
            (answers if ok else failures)[rank] = value
        return answers, failures

    def _healthy(self) -> bool:
        try:
            for q in self.tasks:
                q.put((_ping, ()))
            answers, failures = self._collect(10.0)
            return not failures and len(answers) == self.world
        except Exception:  # noqa: BLE001 - any trouble means a fresh pool
            return False

    def close(self) -> None:
        """Stop the workers (a polite end, then terminate those that do not stop) and remove the folder."""
        self.broken = True
        for q, p in zip(self.tasks, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        deadline = time.monotonic() + 0.5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
        shutil.rmtree(self.folder, ignore_errors=True)


def _report(fn, world: int, failures: dict, missing: list, timeout: float) -> str:
    lines = [f"{getattr(fn, '__name__', fn)} on {world} ranks:"]
    for rank in sorted(failures):
        lines.append(f"rank {rank} of {world} failed:\n{failures[rank]}")
    if missing:
        lines.append(f"rank {', '.join(map(str, missing))} of {world} did not finish within {timeout:.0f} s")
    return "\n".join(lines)

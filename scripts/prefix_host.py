"""Host and device time of the actor's attached prefix pass (vision encode and prompt prefill of one
group, with autograd) against the detached pass, per activation-checkpointing setting, on the ``rollplex
bench schedule`` workload (3B architecture, 3,920-token video prompts, bf16, compiled layers).

The attached prefix runs before decode under prefill fusion and at the start of each of serial's actor
micro-batches; the device waits for the host there (``scripts/host_lag.py``). For each setting, after
one discarded pass each, ``--repeats`` rounds in which every setting passes over the 8 groups in turn,
one group at a time: the host's time to issue the group's pass (the call returns with work still
queued) and the time until the device has run it. The pass's outputs are dropped before the next
group. Settings:

- ``detached``: under ``torch.no_grad()`` (rollout and reference prefix);
- ``checkpoint``: attached, under activation checkpointing as training runs it
  (``models.forward.enable_checkpointing``: non-reentrant, torch's other defaults, which save and
  restore the RNG state around each layer and record each saved tensor's shape and dtype);
- ``checkpoint-norng``: the same with ``preserve_rng_state=False``;
- ``checkpoint-nocheck``: the same with ``determinism_check="none"``;
- ``checkpoint-lean``: both (Qwen2.5-VL has no active dropout);
- ``no-checkpoint``: attached, every activation kept.

Then one attached and one detached pass of one group under cProfile (functions by own time).

Usage (CUDA): python scripts/prefix_host.py [SETTING ...] [--repeats 3] [--out prefix_host.json]
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from rollplex.bench.common import cprofile_report, cuda_script_args, one_of
from rollplex.bench.schedule import default_row
from rollplex.models.forward import enable_checkpointing, prefix_states

CHECKPOINT = {"use_reentrant": False}
SETTINGS = {
    "detached": "runtime",  # checkpointing as training sets it, inactive without autograd
    "checkpoint": "runtime",  # models.forward.enable_checkpointing
    "checkpoint-norng": {**CHECKPOINT, "preserve_rng_state": False},
    "checkpoint-nocheck": {**CHECKPOINT, "determinism_check": "none"},
    "checkpoint-lean": {**CHECKPOINT, "preserve_rng_state": False, "determinism_check": "none"},
    "no-checkpoint": None,
}


def _set_checkpointing(model, kwargs: dict | str | None) -> None:
    if kwargs == "runtime":
        enable_checkpointing(model)
        return
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    if kwargs is None:
        disable()
    elif enable.__name__ == "activation_checkpointing_enable":
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        enable(gradient_checkpointing_kwargs=kwargs)
    model.train(True)


def _group_pass(model, prompt, banned, attached: bool) -> tuple[float, float]:
    """(host seconds to issue, seconds until the device is done) of one group's prefix pass."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    states = prefix_states(model, [prompt], temperature=1.0, banned_ids=banned, attached=attached)
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    done = time.perf_counter() - start
    del states
    return issued, done


def _timings(model, prompts, banned, names: list[str], repeats: int) -> list[dict]:
    """Each setting's row: one discarded group pass per setting (compiles where it is new), then
    ``repeats`` rounds, each running every setting over every group in turn, so that no setting gets
    a later, warmer share of the process."""
    for name in names:
        _set_checkpointing(model, SETTINGS[name])
        _group_pass(model, prompts[0], banned, name != "detached")
    issued, done = {n: [] for n in names}, {n: [] for n in names}
    for _ in range(repeats):
        for name in names:
            _set_checkpointing(model, SETTINGS[name])
            for prompt in prompts:
                i, d = _group_pass(model, prompt, banned, name != "detached")
                issued[name].append(i)
                done[name].append(d)
    rows = [
        {
            "setting": name,
            "groups": len(done[name]),
            "issue_ms_median": 1e3 * statistics.median(issued[name]),
            "done_ms_median": 1e3 * statistics.median(done[name]),
            "done_ms_min": 1e3 * min(done[name]),
            "done_ms_max": 1e3 * max(done[name]),
        }
        for name in names
    ]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    args = cuda_script_args(__doc__, _arguments)
    work, roles, _ = default_row("serial", torch.device("cuda"))
    model, prompts, banned = roles.actor, work.prompts, roles.banned_ids.cuda()
    rows = _timings(model, prompts, banned, args.settings, args.repeats)
    _set_checkpointing(model, "runtime")
    for attached in (True, False):
        text = cprofile_report(
            lambda a=attached: _group_pass(model, prompts[0], banned, a),
            f"{args.out}.{attached}.cprofile.txt",
            45,
            40,
        )
        print(("attached" if attached else "detached"), text[:6000], flush=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}, f, indent=1)


def _arguments(parser) -> None:
    parser.add_argument("settings", nargs="*", type=one_of(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="prefix_host.json")


if __name__ == "__main__":
    main()

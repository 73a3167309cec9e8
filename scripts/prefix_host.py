"""Host and device time of the actor's attached prefix pass (vision encode and prompt prefill of one
group, with autograd) against the detached pass, per activation-checkpointing setting, on the ``rollplex
bench schedule`` workload (3B architecture, 3,920-token video prompts, bf16, compiled layers).

The attached prefix runs before decode under prefill fusion and at the start of each of serial's actor
micro-batches; the device waits for the host there (``scripts/host_lag.py``). For each setting, after
one discarded pass, ``--repeats`` passes over the 8 groups, one group at a time: the host's time to
issue the group's pass (the call returns with work still queued) and the time until the device has
run it. The pass's outputs are dropped before the next group. Settings:

- ``detached``: under ``torch.no_grad()`` (rollout and reference prefix);
- ``checkpoint-torch``: attached, non-reentrant activation checkpointing with torch's other defaults
  (the RNG state saved and restored around each layer, a shape/dtype record of each saved tensor);
- ``checkpoint-norng``: the same with ``preserve_rng_state=False``;
- ``checkpoint-nocheck``: the same with ``determinism_check="none"``;
- ``checkpoint``: both, as training runs it (``models.forward.checkpoint_options``; Qwen2.5-VL has no
  active dropout);
- ``no-checkpoint``: attached, every activation kept.

Then one attached and one detached pass of one group under cProfile (functions by own time).

Usage (CUDA): python scripts/prefix_host.py [SETTING ...] [--repeats 3] [--out prefix_host.json]
"""

from __future__ import annotations

import gc
import json
import statistics
import time

import torch

from rollplex.bench.common import cprofile_report, cuda_script_args, one_of
from rollplex.bench.schedule import default_row
from rollplex.models.forward import enable_checkpointing, prefix_states

CHECKPOINT = {"use_reentrant": False}
SETTINGS = {
    "detached": None,
    "checkpoint-torch": CHECKPOINT,
    "checkpoint-norng": {**CHECKPOINT, "preserve_rng_state": False},
    "checkpoint-nocheck": {**CHECKPOINT, "determinism_check": "none"},
    "checkpoint": "runtime",  # models.forward.checkpoint_options
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
    gc.collect()  # non-reentrant checkpointing's reference cycles hold the pass's tensors until collected
    return issued, done


def _setting(model, prompts, banned, name: str, repeats: int) -> dict:
    _set_checkpointing(model, SETTINGS[name] if name != "detached" else "runtime")
    attached = name != "detached"
    _group_pass(model, prompts[0], banned, attached)  # compiles where the setting is new
    issued, done = [], []
    for _ in range(repeats):
        for prompt in prompts:
            i, d = _group_pass(model, prompt, banned, attached)
            issued.append(i)
            done.append(d)
    row = {
        "setting": name,
        "groups": len(prompts) * repeats,
        "issue_ms_median": 1e3 * statistics.median(issued),
        "done_ms_median": 1e3 * statistics.median(done),
        "done_ms_min": 1e3 * min(done),
        "done_ms_max": 1e3 * max(done),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    args = cuda_script_args(__doc__, _arguments)
    work, roles, _ = default_row("serial", torch.device("cuda"))
    model, prompts, banned = roles.actor, work.prompts, roles.banned_ids.cuda()
    rows = [_setting(model, prompts, banned, name, args.repeats) for name in args.settings]
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
        json.dump({"rows": rows}, f, indent=1)


def _arguments(parser) -> None:
    parser.add_argument("settings", nargs="*", type=one_of(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="prefix_host.json")


if __name__ == "__main__":
    main()

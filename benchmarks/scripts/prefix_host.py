"""Host and device time of the actor's attached prefix pass (vision encode and prompt prefill of one
group, with autograd) against the detached pass, per activation-checkpointing setting, on the ``rollplex
bench schedule`` workload (3B architecture, 3,920-token video prompts, bf16, compiled layers). With
``--pass train``, each attached group pass is the actor's whole micro-batch: the prefix, the suffix of
its 8 responses of 512 tokens (random text tokens) and the backward of their mean log-prob.

The attached prefix runs before decode under prefill fusion and at the start of each of serial's actor
micro-batches; under torch's checkpoint the device waited for the host there
(``benchmarks/scripts/host_lag.py``). For each setting, after one discarded pass each, ``--repeats``
rounds in which every setting passes over the 8 groups, one group at a time, the settings in a new
shuffled order each round (seeded): the host's time to issue the group's pass (the call returns with
work still queued), the time until the device has run it, and the memory the pass left allocated once
its outputs are dropped (more than zero is a leak). Settings:

- ``detached``: under ``torch.no_grad()``, on the actor as training sets it up (the rollout prefix;
  the reference model has no checkpointing);
- ``checkpoint``: attached, under activation checkpointing as training runs it
  (``models.forward.enable_checkpointing``: layer recompute, ``models.recompute``, whose forward runs
  each layer without autograd);
- ``checkpoint-torch``: attached, under torch's non-reentrant checkpoint in every layer (training's
  checkpointing before layer recompute; torch's defaults save and restore the RNG state around each
  layer and record each saved tensor's shape and dtype);
- ``no-checkpoint``: attached, every activation kept.

Then one attached pass (checkpointed as training runs it) and one detached pass of one group under
cProfile: OUT.attached.cprofile.txt and OUT.detached.cprofile.txt, functions by own time, then by
cumulative time.

Usage (CUDA): python benchmarks/scripts/prefix_host.py [SETTING ...] [--repeats 3] [--pass prefix|train] [--out prefix_host.json]
"""

from __future__ import annotations

import json
import random
import statistics
import time

import torch

from rollplex.bench.common import cprofile_report, cuda_script_args, int_between, one_of
from rollplex.bench.schedule import default_row
from rollplex.models.forward import enable_checkpointing, prefix_states, suffix_logprobs

# each setting's models.forward.enable_checkpointing arguments; None: checkpointing off
SETTINGS = {
    "detached": {},  # the actor as training sets it up, run under torch.no_grad()
    "checkpoint": {},
    "checkpoint-torch": {"layer_recompute": False},
    "no-checkpoint": None,
}
RESPONSES, RESPONSE_TOKENS = 8, 512


def _set_checkpointing(model, name: str) -> None:
    """Checkpointing enabled as setting ``name`` says, or off."""
    arguments = SETTINGS[name]
    if arguments is not None:
        enable_checkpointing(model, **arguments)
        return
    if hasattr(model, "activation_checkpointing_disable"):  # transformers releases after 5.17
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
    model.train(True)


def _group_pass(model, prompt, banned, attached: bool, train: bool = False) -> tuple[float, float, float]:
    """(host seconds to issue, seconds until the device is done, GiB the pass left allocated once its
    outputs and gradients are dropped) of one group's prefix pass; with ``train`` (attached only), the
    suffix of ``RESPONSES`` random responses and the backward too."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    states = prefix_states(model, [prompt], temperature=1.0, banned_ids=banned, attached=attached)
    if train and attached:
        responses = torch.randint(1000, 2000, (RESPONSES, RESPONSE_TOKENS), device=banned.device)
        logprobs, _ = suffix_logprobs(
            model, states[0], responses, group_size=RESPONSES, temperature=1.0, banned_ids=banned
        )
        logprobs.float().mean().backward()
        del logprobs
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    done = time.perf_counter() - start
    del states
    model.zero_grad(set_to_none=True)
    return issued, done, (torch.cuda.memory_allocated() - before) / 2**30


def _timings(model, prompts, banned, names: list[str], repeats: int, train: bool) -> list[dict]:
    """Each setting's row: one discarded group pass per setting (compiles where it is new), then
    ``repeats`` rounds, each running every setting over every group in turn, in an order shuffled
    anew each round (seeded), so that no setting always follows the same one."""
    for name in names:
        _set_checkpointing(model, name)
        _group_pass(model, prompts[0], banned, name != "detached", train)
    passes = {n: [] for n in names}
    order = random.Random(0)
    for _ in range(repeats):
        for name in order.sample(names, len(names)):
            _set_checkpointing(model, name)
            passes[name] += [_group_pass(model, p, banned, name != "detached", train) for p in prompts]
    _set_checkpointing(model, "checkpoint")
    rows = [_row(name, passes[name]) for name in names]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def _row(name: str, passes: list[tuple[float, float, float]]) -> dict:
    issued, done, left = zip(*passes, strict=True)
    return {
        "setting": name,
        "groups": len(done),
        "issue_ms_median": 1e3 * statistics.median(issued),
        "done_ms_median": 1e3 * statistics.median(done),
        "done_ms_min": 1e3 * min(done),
        "done_ms_max": 1e3 * max(done),
        "left_allocated_gib_max": max(left),
    }


def main() -> None:
    args = cuda_script_args(__doc__, _arguments)
    work, roles, _ = default_row("serial", torch.device("cuda"))
    model, prompts, banned = roles.actor, work.prompts, roles.banned_ids.cuda()
    train = args.pass_ == "train"
    rows = _timings(model, prompts, banned, list(dict.fromkeys(args.settings)), args.repeats, train)
    for attached in (True, False):
        text = cprofile_report(
            lambda a=attached: _group_pass(model, prompts[0], banned, a, train),
            f"{args.out}.{'attached' if attached else 'detached'}.cprofile.txt",
            45,
            40,
        )
        print(("attached" if attached else "detached"), text[:6000], flush=True)
    with open(args.out, "w") as f:
        peak = torch.cuda.max_memory_allocated() / 2**30
        json.dump({"pass": args.pass_, "rows": rows, "peak_gib": peak}, f, indent=1)


def _arguments(parser) -> None:
    parser.add_argument(
        "settings",
        nargs="*",
        type=one_of(SETTINGS),
        default=list(SETTINGS),
        help="settings to time (default: all)",
    )
    parser.add_argument(
        "--repeats",
        type=int_between(1, 100),
        default=3,
        help="rounds over the 8 groups per setting (default 3)",
    )
    parser.add_argument(
        "--pass",
        dest="pass_",
        choices=("prefix", "train"),
        default="prefix",
        help="each attached pass: the prefix alone, or the actor's micro-batch with its backward (default prefix)",
    )
    parser.add_argument(
        "--out",
        default="prefix_host.json",
        help="JSON of the rows; the profiles go beside it (OUT.*.cprofile.txt)",
    )


if __name__ == "__main__":
    main()

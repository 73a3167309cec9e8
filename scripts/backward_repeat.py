"""Whether the actor's backward pass repeats itself bit for bit, where it first does not, and what
torch's deterministic algorithms cost there, on the ``rollplex bench schedule`` workload (3B
architecture, 8 groups of 3,920-token video prompts, N = 8, 512-token responses, serial row).

One rollout, rewards and reference log-probs; then the same ``phases.actor_backward`` over all groups,
from zeroed gradients, several times per setting:

- ``default``: the default kernels;
- ``deterministic``: ``torch.use_deterministic_algorithms(True)`` with new allocations left unfilled
  (``torch.utils.deterministic.fill_uninitialized_memory = False``);
- ``deterministic+fill``: the same with new allocations filled (torch's default in that mode, as
  ``run.deterministic`` runs).

Each repeat's gradients (bf16, the model's dtype) are compared with the setting's first repeat,
parameter by parameter: bitwise equal or not, and the relative L2 difference. Parameters are listed in
backward order (the LM head and the last layer first) so the first one differing shows where the
difference enters. The first repeat after a setting changes includes recompilation (dynamo guards on the
deterministic flag); the times to compare are the later repeats'.

Usage (CUDA): python scripts/backward_repeat.py [SETTING ...] [--repeats 3] [--out repeat.json]
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch

from rollplex.bench.common import cuda_script_args, one_of
from rollplex.bench.schedule import default_row
from rollplex.loop import use_deterministic_algorithms
from rollplex.phases import actor_backward, reference_phase, reward_phase, rollout_phase

SETTINGS = ("default", "deterministic", "deterministic+fill")


def _set(setting: str) -> None:
    if setting == "default":
        torch.use_deterministic_algorithms(False)
        return
    use_deterministic_algorithms()
    torch.utils.deterministic.fill_uninitialized_memory = setting.endswith("+fill")


def _backward(roles, scored, groups) -> tuple[float, dict[str, torch.Tensor]]:
    roles.optimizer.zero_grad()
    torch.cuda.synchronize()
    start = time.perf_counter()
    actor_backward(roles, scored, groups, None)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grads = {n: p.grad for n, p in roles.actor.named_parameters() if p.grad is not None}
    return seconds, grads


def _backward_order(name: str) -> tuple:
    """Sort key: LM head and final norm first, then layers from the last, each from its MLP to its input
    norm, then the embeddings and the vision tower."""
    layer = re.search(r"language_model\.layers\.(\d+)\.(.*)", name)
    if layer is None:
        head = "lm_head" in name or name.endswith("language_model.norm.weight")
        return (0 if head else 2, 0, name)
    part = layer.group(2)
    within = next(
        (i for i, key in enumerate(("mlp.down", "mlp.", "post_attention", "o_proj")) if key in part), 4
    )
    return (1, -int(layer.group(1)), within, part)


def _compare(first: dict[str, torch.Tensor], again: dict[str, torch.Tensor]) -> dict:
    names = sorted(first, key=_backward_order)
    differing = []
    for name in names:
        a, b = first[name], again[name]
        if not torch.equal(a, b):
            rel = float((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-300))
            differing.append({"name": name, "rel_diff": rel})
    return {
        "parameters": len(names),
        "differing": len(differing),
        "first_in_backward_order": differing[:8],
        "largest_rel_diff": max((d["rel_diff"] for d in differing), default=0.0),
    }


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "settings", nargs="*", type=one_of(SETTINGS), help=f"any of {', '.join(SETTINGS)} (default: all)"
        )
        parser.add_argument("--repeats", type=int, choices=range(2, 11), default=3, metavar="2..10")
        parser.add_argument("--out", help="write the results as JSON here")

    args = cuda_script_args(__doc__, arguments)
    settings = args.settings or list(SETTINGS)
    work, roles, _ = default_row("serial", torch.device("cuda"))
    cfg = roles.config
    rollout = rollout_phase(roles, work.prompts, cfg.rollout.group_size, roles.sampling)
    scored = reference_phase(roles, reward_phase(roles, rollout))
    groups = list(range(len(work.prompts)))
    results = {"gpu": torch.cuda.get_device_name(), "settings": {}}
    for setting in settings:
        _set(setting)
        seconds, grads = _backward(roles, scored, groups)
        first = {n: g.clone() for n, g in grads.items()}
        times, repeats = [seconds], []
        for _ in range(args.repeats - 1):
            seconds, grads = _backward(roles, scored, groups)
            times.append(seconds)
            repeats.append(_compare(first, grads))
        results["settings"][setting] = {"seconds": times, "repeats": repeats}
        print(setting, "seconds", [round(t, 3) for t in times], flush=True)
        for i, rep in enumerate(repeats, 2):
            print(f"  repeat {i}: {rep['differing']} of {rep['parameters']} gradients differ", flush=True)
            for d in rep["first_in_backward_order"]:
                print(f"    {d['name']}: rel diff {d['rel_diff']:.3e}", flush=True)
        del first, grads
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

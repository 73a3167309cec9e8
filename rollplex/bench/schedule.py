"""``rollplex bench schedule``: one training workload under several schedules, side by side in one process.

Rows (each from the same initial weights and optimizer state, same prompts and seeds):

    serial      the paper's Colocate baseline
    overlap     rollplex: reference and actor prefixes on a worker stream during decode
    fusion      rollplex without overlap, with prefill fusion (the actor prefix seeds decode)
    both        rollplex with overlap and prefill fusion

Warm-up iterations (allocator growth, kernel selection) are discarded; the table gives the median step
time and its spread, the speedup over serial, the phase times behind the paper's Eq. 1 (T_D = serial
decode, T_P = prefix makespan, ΔD = decode slowdown under overlap, measured saving S and the bound
min(T_D, T_P)), peak memory, and the largest parameter difference from serial after the timed steps.
"""

from __future__ import annotations

import copy
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rollplex.bench.common import PromptShape, Workload, bench_device, random_model, synthetic_prompt
from rollplex.config import load_config
from rollplex.observe.metrics import PhaseTimer
from rollplex.optim import MasterWeightAdamW
from rollplex.phases import Roles
from rollplex.rollout.engine import SamplingParams
from rollplex.schedule.rollplex import rollplex_step
from rollplex.schedule.serial import serial_step

ROWS = {
    "serial": {"run.schedule": "serial"},
    "overlap": {"run.schedule": "rollplex", "run.overlap": True, "run.prefill_fusion": False},
    "fusion": {"run.schedule": "rollplex", "run.overlap": False, "run.prefill_fusion": True},
    "both": {"run.schedule": "rollplex", "run.overlap": True, "run.prefill_fusion": True},
}


@dataclass(frozen=True)
class ScheduleBenchConfig(Workload):
    """Workload of ``rollplex bench schedule`` (defaults: the 3B workload of docs/benchmarks.md)."""

    warmup: int = 1
    steps: int = 3
    rows: tuple[str, ...] = tuple(ROWS)
    gradient_checkpointing: bool = True


@dataclass
class ScheduleBenchResult:
    config: dict
    rows: dict = field(default_factory=dict)


class _Workload:
    """Model, reference, initial state and prompts shared by every row."""

    def __init__(self, cfg: ScheduleBenchConfig, device: torch.device):
        from rollplex.models.presets import vision_special_ids
        from rollplex.models.tokenizer import build_tokenizer

        dtype = getattr(torch, cfg.dtype)
        self.actor = random_model(cfg.preset, device, dtype)
        if cfg.gradient_checkpointing:
            self.actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.actor.train(True)
        self.reference = copy.deepcopy(self.actor).requires_grad_(False)
        self.initial = {k: v.detach().clone() for k, v in self.actor.state_dict().items()}
        self.tokenizer = build_tokenizer(cfg.preset)
        shape = PromptShape(cfg.text_tokens, cfg.grid)
        self.prompts = [
            synthetic_prompt(self.actor, shape, seed=g, device=device, dtype=dtype) for g in range(cfg.groups)
        ]
        banned = torch.tensor(vision_special_ids(self.actor.config), device=device)
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.sampling = SamplingParams(1.0, 1.0, 0, cfg.response_tokens, (eos,), eos, banned)
        self.device = device

    def roles(self, overrides: dict, cfg: ScheduleBenchConfig) -> Roles:
        """Fresh roles from the initial weights for one row."""
        with torch.no_grad():
            for name, value in self.actor.state_dict().items():
                value.copy_(self.initial[name])
        items = {
            "rollout.group_size": cfg.group_size,
            "rollout.prompts_per_step": cfg.groups,
            "rollout.max_response_tokens": cfg.response_tokens,
            "reward.functions": "[answer_accuracy]",
            **overrides,
        }
        config = load_config(
            None, [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in items.items()]
        )
        o = config.optim
        params = [p for p in self.actor.parameters() if p.requires_grad]
        optimizer = MasterWeightAdamW(
            params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
        )
        generator = torch.Generator(device=self.device).manual_seed(0)
        return Roles(self.actor, self.reference, optimizer, self.tokenizer, self.sampling, generator, config)


def _run_row(work: _Workload, name: str, cfg: ScheduleBenchConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    roles = work.roles(ROWS[name], cfg)
    step = rollplex_step if roles.config.run.schedule == "rollplex" else serial_step
    sync = torch.cuda.synchronize if work.device.type == "cuda" else None
    timer, times, phases = PhaseTimer(sync=sync), [], []
    if work.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(work.device)
    for i in range(cfg.warmup + cfg.steps):
        start = timer.now()
        step(roles, work.prompts, timer)
        end = timer.now()
        spent = timer.pop()
        if i >= cfg.warmup:
            times.append(end - start)
            phases.append(spent)
    row = {
        "step_s_median": statistics.median(times),
        "step_s_spread": max(times) - min(times),
        **{
            key: statistics.median(p.get(key, 0.0) for p in phases)
            for key in sorted({k for p in phases for k in p})
        },
    }
    if work.device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(work.device) / 2**30
    print(f"  {name}: {row['step_s_median']:.3f} s/step (spread {row['step_s_spread']:.3f})", flush=True)
    return row, {k: v.detach().clone() for k, v in work.actor.state_dict().items()}


def _eq1(rows: dict) -> None:
    """Fill the Eq. 1 terms (paper §3.1) into the rows, relative to serial."""
    serial = rows.get("serial")
    sequential = rows.get("fusion")
    if serial is None:
        return
    t_d = serial.get("time/rollout", 0.0)
    t_p = sequential.get("time/prefix", float("nan")) if sequential else float("nan")
    for row in rows.values():
        row["speedup_vs_serial"] = serial["step_s_median"] / row["step_s_median"]
        row["T_D"], row["T_P"], row["bound_min_TD_TP"] = t_d, t_p, min(t_d, t_p)
        row["delta_D"] = row.get("time/rollout", t_d) - t_d
        row["saving_S"] = serial["step_s_median"] - row["step_s_median"]


def run_schedule_bench(cfg: ScheduleBenchConfig, out: Path | None = None) -> ScheduleBenchResult:
    """Run every row of ``cfg.rows`` and print the table.

    Raises:
        ValueError: an unknown row name, or a preset other than ``tiny`` without a CUDA device.
    """
    unknown = set(cfg.rows) - set(ROWS)
    if unknown:
        raise ValueError(f"unknown schedule rows {sorted(unknown)}; expected some of {list(ROWS)}")
    device = bench_device(cfg.preset)
    work = _Workload(cfg, device)
    result = ScheduleBenchResult(config=asdict(cfg))
    weights = {}
    for name in cfg.rows:
        result.rows[name], weights[name] = _run_row(work, name, cfg)
    if "serial" in weights:
        for name, state in weights.items():
            diff = max(float((state[k].float() - weights["serial"][k].float()).abs().max()) for k in state)
            result.rows[name]["max_abs_param_diff_vs_serial"] = diff
    _eq1(result.rows)
    _print(result)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(result), indent=2))
    return result


def _print(result: ScheduleBenchResult) -> None:
    keys = [
        "step_s_median",
        "step_s_spread",
        "speedup_vs_serial",
        "time/rollout",
        "time/prefix",
        "T_D",
        "T_P",
        "delta_D",
        "saving_S",
        "bound_min_TD_TP",
        "peak_memory_gib",
        "max_abs_param_diff_vs_serial",
    ]
    keys = [k for k in keys if any(k in row for row in result.rows.values())]
    print(f"{'schedule':10} " + " ".join(f"{k:>16}" for k in keys))
    for name, row in result.rows.items():
        print(f"{name:10} " + " ".join(f"{row.get(k, float('nan')):16.4g}" for k in keys))

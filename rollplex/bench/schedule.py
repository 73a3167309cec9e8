"""``rollplex bench schedule``: one training workload under several schedules, side by side in one process.

Rows: ``bench.variants.ROWS_HELP`` (each from the same initial weights and optimizer state, same prompts
and seeds; ``rollplex bench schedule --help`` prints it).

Warm-up iterations (allocator growth, graph capture, compilation, the rollplex schedule's calibration
steps, and auto's policy trials) are discarded; the table gives the median step time and its spread, the speedup over the row's baseline
(``BASELINES``: serial, or serial-whole-batch for the whole-batch rows; the JSON's ``*_vs_serial`` keys
mean that row, named in ``baseline``), the Phase-1 makespan, the paper's Eq. 1 terms as every step
records them (schedule.critical_path: T_D standalone decode, T_P prefix makespan, ΔD decode slowdown from
co-running, S measured saving, bound min(T_D, T_P), T_post), the gradient norm (``grad_norm``: the
median step's largest norm before clipping; inf where an update was skipped), decode seconds per step
and its ratio to the memory roofline (bench.decode), peak memory, the memory still allocated after each
step (``allocated_gib_by_step``, warm-up steps included; growth is a leak), the seconds Python's garbage
collector ran in each step (``gc_s_by_step``, warm-up included; ``gc_s``, ``gc_passes`` and ``gc_full_passes``
the timed steps' medians; also printed per iteration; the collector is tuned as in a training run,
``observe.metrics.GcClock``), the caching allocator's retries (a
cudaMalloc that failed, freed the cache and retried) and device frees over the row's iterations, the
largest bf16 parameter difference from the baseline after the timed steps, the relative difference
of the FP32 updates (``Updates``), and how many of the
optimizer's FP32 tensors (master weights, AdamW moments) differ from the baseline's
(``bench.fingerprint``: the bf16 weights alone can hide a different update), with the first step
whose sampled tokens, recorded log-probs, advantages, reference log-probs, actor statistics or
gradient norms differ from the baseline's (``first_step_differing``: in rollout, in the training
forward, or in its backward; ``step_fingerprints`` says what a difference can hide in), with a verdict
line per row that has a baseline (``verdict``: the same update bitwise, where it differs, or why it
was not compared: ``not_compared``) and the number of FP32 tensors compared (``optimizer_tensors``).
Responses are scored by ``bench.common.distinct_reward``, so the update is not zero. A row that fails is
recorded with its error, and the others run.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rollplex.bench.common import PromptShape, Workload, bench_device, synthetic_prompt, workload_model
from rollplex.bench.decode import copy_bandwidth, step_bytes
from rollplex.bench.fingerprint import differing, first_difference, optimizer_fingerprints, step_fingerprints
from rollplex.bench.parallel import run_parallel_schedule_bench, world_size
from rollplex.bench.variants import BASELINES, MAIN_ROWS, ROWS, TORCHRUN_ROWS
from rollplex.config import Config, ConfigError, load_config
from rollplex.determinism import use_deterministic_algorithms
from rollplex.memory.host_pool import PinnedHostPool
from rollplex.memory.plan_command import PlanInputs, available_host_gib
from rollplex.memory.planner import MemoryPlan
from rollplex.memory.runtime import MemoryRuntime, build_memory, enforce_budget, plan_run
from rollplex.memory.runtime import step_metrics as memory_metrics
from rollplex.models.compiled import compile_fallback, compiled_scope, compiles_layers
from rollplex.models.forward import enable_checkpointing, prepare_model, suffix_backend
from rollplex.observe.metrics import GcClock, PhaseTimer
from rollplex.phases import Roles
from rollplex.rollout.engine import SamplingParams
from rollplex.schedule import make_step
from rollplex.schedule.prefix_overlap import CALIBRATION_STEPS, PrefixOverlapSchedule


@dataclass(frozen=True)
class ScheduleBenchConfig(Workload):
    """Workload of ``rollplex bench schedule`` (defaults: the 3B workload of benchmarks/README.md)."""

    warmup: int = CALIBRATION_STEPS  # a new rollplex run's calibration steps
    steps: int = 2
    rows: tuple[str, ...] = MAIN_ROWS
    gradient_checkpointing: bool = True
    compile_decode: bool = True
    compile_mode: str = "default"
    auto_trials: int = 2
    decode_attention: str = "auto"
    fused_projections: bool = True
    fused_sampling: bool = True
    fused_gate: bool = True
    deterministic: bool = False  # torch's deterministic algorithms for the whole run (run.deterministic)
    # config overrides (section.field=value, as rollplex train takes them) applied to every row's config
    # after the settings above; a row's own settings (ROWS) win over them
    overrides: tuple[str, ...] = ()
    # compare each row's update with its baseline's (host copies of the weights and the FP32 update of
    # the baseline rows); off: times and memory only
    compare: bool = True


@dataclass
class ScheduleBenchResult:
    config: dict
    copy_bandwidth_gbps: float = float("nan")
    host_pool_pin_s: float = 0.0  # seconds page-locking the host pool the rows share
    rows: dict = field(default_factory=dict)


class _Workload:
    """Model, reference, initial state and prompts shared by every row, and the one pinned host pool the
    rows take in turn (``run_schedule_bench`` sizes it for the largest row's plan)."""

    def __init__(self, cfg: ScheduleBenchConfig, device: torch.device):
        from rollplex.models.presets import vision_special_ids
        from rollplex.models.tokenizer import build_tokenizer

        dtype = getattr(torch, cfg.dtype)
        self.actor = workload_model(cfg, device)
        self.checkpointing = cfg.gradient_checkpointing
        if self.checkpointing:  # before the copy, which the reference has always been made from
            enable_checkpointing(self.actor)
        self.reference = copy.deepcopy(self.actor).requires_grad_(False)
        # on the host: a device copy would sit in every row's memory
        self.initial = {k: v.detach().to("cpu", copy=True) for k, v in self.actor.state_dict().items()}
        # every row plans with the host memory there was before the rows' shared pool was pinned
        self.host_available_gib = available_host_gib()
        self.tokenizer = build_tokenizer(cfg.preset)
        self.shape = PromptShape(cfg.text_tokens, cfg.grid)
        self.prompts = [
            synthetic_prompt(self.actor, self.shape, seed=g, device=device, dtype=dtype)
            for g in range(cfg.groups)
        ]
        self.banned = torch.tensor(vision_special_ids(self.actor.config), device=device)
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.device = device
        self.sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        )
        self.updates: Updates | None = None  # set by run_schedule_bench
        self.pool: PinnedHostPool | None = None  # set by run_schedule_bench
        self.memory: MemoryRuntime | None = None  # the running row's (memory.runtime)

    def plan(self, config: Config) -> MemoryPlan:
        """The memory plan of a row's config for this workload's prompt shape."""
        vision = self.shape.length - self.shape.text_tokens
        inputs = PlanInputs(
            prompt_tokens=self.shape.length, vision_tokens=vision, host_available_gib=self.host_available_gib
        )
        return plan_run(config, self.device, inputs)

    def roles(self, overrides: dict, cfg: ScheduleBenchConfig) -> Roles:
        """Fresh roles from the initial weights for one row, its memory set up as a training run's
        (``memory.runtime``: the plan's budget enforced on the device, the reference paged, activations
        offloaded and optimizer state in the host pool where the plan says)."""
        config = row_config(overrides, cfg, self.sms)
        plan = self.plan(config)
        with torch.no_grad():
            for name, value in self.actor.state_dict().items():
                value.copy_(self.initial[name])
        if self.checkpointing:
            enable_checkpointing(self.actor, layer_recompute=config.model.layer_recompute)
        model_cfg = config.model
        compiled = compiles_layers(model_cfg.compile_layers, self.device)
        for model in (self.actor, self.reference):
            prepare_model(
                model,
                model_cfg.vision_attention,
                model_cfg.vision_mlp_padding,
                compiled,
                model_cfg.compile_scope,
            )
        enforce_budget(plan.budget_gib, self.device)
        if self.pool is None:
            self.pool = PinnedHostPool(plan.host_pool_bytes)
        self.pool.clear()
        self.memory = build_memory(plan, config, self.device, self.actor, self.reference, pool=self.pool)
        sampling = SamplingParams.from_config(config.rollout, (self.eos,), self.eos, self.banned)
        generator = torch.Generator(device=self.device).manual_seed(0)
        return Roles(
            self.actor,
            self.reference,
            self.memory.optimizer,
            self.tokenizer,
            sampling,
            generator,
            config,
            residency=self.memory.residency,
            offload=self.memory.offload,
        )

    def end_row(self) -> None:
        """After a row: the reference back on the device, the budget lifted, the row's memory dropped."""
        if self.memory is not None:
            self.memory.residency.restore()
            self.memory = None
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(1.0, index)


def row_config(overrides: dict, cfg: ScheduleBenchConfig, sms: int) -> Config:
    """The config of one row: the workload's settings, then ``cfg.overrides``, then the row's own
    (``overrides``; "half" = half the device's ``sms``)."""
    workload = {
        "rollout.group_size": cfg.group_size,
        "rollout.prompts_per_step": cfg.groups,
        "rollout.max_response_tokens": cfg.response_tokens,
        "reward.functions": "[rollplex.bench.common:distinct_reward]",
        "schedule.auto_trials": cfg.auto_trials,
        "rollout.decode_attention": cfg.decode_attention,
        "rollout.compile_decode": cfg.compile_decode,
        "rollout.compile_mode": cfg.compile_mode,
        "rollout.fused_projections": cfg.fused_projections,
        "rollout.fused_sampling": cfg.fused_sampling,
        "rollout.fused_gate": cfg.fused_gate,
        "model.preset": cfg.preset,  # the memory planner's shapes
        "model.gradient_checkpointing": cfg.gradient_checkpointing,
        "model.vision_attention": cfg.vision_attention,
        "model.vision_mlp_padding": cfg.vision_mlp_padding,
        "model.compile_layers": cfg.compile_layers,
        "model.compile_scope": cfg.compile_scope,
        "run.dtype": cfg.dtype,
        "run.deterministic": cfg.deterministic,  # recorded; run_schedule_bench sets it process-wide
    }
    row = {k: sms // 2 if v == "half" else v for k, v in overrides.items()}
    return load_config(None, [*_items(workload), *cfg.overrides, *_items(row)])


def _items(settings: dict) -> list[str]:
    """``section.field=value`` overrides of a settings dict (booleans as YAML spells them)."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]


def default_row(
    name: str, device: torch.device, cfg: ScheduleBenchConfig | None = None
) -> tuple[_Workload, Roles, Callable]:
    """The workload of ``cfg`` (default: the default workload) on ``device``, with row ``name``'s roles
    and step function (for ``rollplex bench profile`` and scripts that probe one row).

    Raises:
        KeyError: ``name`` is not a row of ``ROWS``.
    """
    cfg = cfg if cfg is not None else ScheduleBenchConfig()
    work = _Workload(cfg, device)
    roles = work.roles(ROWS[name], cfg)
    return work, roles, make_step(roles.config, device)


def _warmup(step, cfg: ScheduleBenchConfig) -> int:
    """Discarded iterations: ``cfg.warmup``, and for ``auto`` also one per policy it tries. Where fewer
    than the rollplex schedule's calibration steps are discarded, a line says what the first timed steps
    are instead of the row's own: calibration steps (prefixes after decode), or auto's trials."""
    trials = len(getattr(step, "trials", []))
    early = min(CALIBRATION_STEPS - cfg.warmup, cfg.steps)
    if isinstance(step, PrefixOverlapSchedule) and early > 0 and (step.auto or step.policy.overlap):
        what = "are auto's trials" if step.auto else "calibrate (prefixes after decode)"
        print(
            f"    the first {early} timed step(s) {what}: --warmup {CALIBRATION_STEPS} leaves them out",
            flush=True,
        )
    return cfg.warmup + trials


def _gc_text(spent: dict) -> str:
    """The garbage collector's share of a step, as the iteration line prints it."""
    full = spent["gc_full_passes"]
    return f"garbage collector {spent['gc_s']:.3f} s in {spent['gc_passes']} passes, {full} full"


def _timed_row(work: _Workload, name: str, cfg: ScheduleBenchConfig) -> tuple[dict, _Snapshot | None]:
    replaced = sorted({item.partition("=")[0].strip() for item in cfg.overrides} & set(ROWS[name]))
    if replaced:  # the row is what its name says
        print(f"  {name}: the row's own {', '.join(replaced)} replaces the override", flush=True)
    # the plan is said before anything is allocated, so a row that runs out of memory has said why
    plan = work.plan(row_config(ROWS[name], cfg, work.sms))
    print(
        f"  {name}: plan peak {plan.planned_peak_gib:.1f} GiB of {plan.budget_gib:.1f} "
        f"({'fits' if plan.fits else 'does not fit: ' + plan.advice}); moves: "
        f"{', '.join(m.what for m in plan.moves) or 'none'}",
        flush=True,
    )
    try:
        return _measured_row(work, name, cfg, work.roles(ROWS[name], cfg))
    finally:
        work.end_row()


def _plan_fields(plan: MemoryPlan) -> dict:
    """A row's memory plan, as its result records it: budget, predicted peak, whether it fits, moves."""
    return {
        "budget_gib": plan.budget_gib,
        "memory/predicted_peak_gib": plan.planned_peak_gib,
        "plan_fits": plan.fits,
        "plan_moves": [m.what for m in plan.moves],
        "optimizer_host_fraction": plan.optimizer_host_fraction,
        "host_pool_gib": plan.host_pool_bytes / 2**30,
    }


def _measured_row(work: _Workload, name: str, cfg: ScheduleBenchConfig, roles: Roles):
    dtype = next(roles.actor.parameters()).dtype
    suffix_backend(work.device, dtype, roles.config.model.suffix_attention)  # the row's can run here
    step = make_step(roles.config, work.device)
    sync = torch.cuda.synchronize if work.device.type == "cuda" else None
    timer, times, phases = PhaseTimer(sync=sync), [], []
    if work.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(work.device)
        torch.cuda.reset_accumulated_memory_stats(work.device)
    warmup, trail, held, collected = _warmup(step, cfg), [], [], []
    with GcClock() as gc_clock:
        for i in range(warmup + cfg.steps):
            gc_clock.pop()
            start = timer.now()
            scored, stats, norms, extra = step(roles, work.prompts, timer)
            end = timer.now()
            gc_spent = gc_clock.pop()
            trail.append(step_fingerprints(scored, stats, norms))  # after the step's clock: not timed
            if work.device.type == "cuda":  # what outlives each step, warm-up included: growth is a leak
                held.append(round(torch.cuda.memory_allocated(work.device) / 2**30, 3))
            collected.append(round(gc_spent["gc_s"], 3))
            spent = {**timer.pop(), **extra, **gc_spent, "grad_norm": _largest(norms)}
            spent.update(memory_metrics(work.memory))
            spent["decode/setup_s"] = scored.rollout.setup_s
            print(f"    {name} iteration {i}: {end - start:.3f} s ({_gc_text(gc_spent)})", flush=True)
            if i >= warmup:
                times.append(end - start)
                phases.append(spent)
            gc_clock.step_done()  # as a training run does
    row = {
        "steps_taken": warmup + cfg.steps,
        "step_s_median": statistics.median(times),
        "step_s_spread": max(times) - min(times),
        **{
            key: statistics.median(p.get(key, float("nan")) for p in phases)
            for key in sorted({k for p in phases for k in p})
        },
    }
    row["gc_s_by_step"] = collected  # warm-up included
    row.update(_plan_fields(work.memory.plan))
    if work.device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated(work.device) / 2**30
        row["allocated_gib_by_step"] = held
        churn = torch.cuda.memory_stats(work.device)  # allocator churn over the row's iterations
        row["alloc_retries"] = churn.get("num_alloc_retries", 0)
        row["device_allocs"] = churn.get("num_device_alloc", 0)
        row["device_frees"] = churn.get("num_device_free", 0)
    fallback = compile_fallback() if compiled_scope(work.actor) is not None else None
    if fallback is not None:  # the row's layers were to run compiled and ran uncompiled
        row["compile_fallback"] = fallback
        print(f"  {name}: layers ran uncompiled: {fallback}", flush=True)
    if getattr(step, "trials", None):
        left = len(step.trials) - step.trials_done
        if left:  # too few steps for every trial: auto has kept no policy
            row["auto_trials_left"] = left
        else:
            row["auto_policy"] = step.policy.name
        row["auto_trials_span_s"] = {p.name: statistics.median(t) for p, t in step.timings.items()}
    print(f"  {name}: {row['step_s_median']:.3f} s/step (spread {row['step_s_spread']:.3f})", flush=True)
    if held:
        print(f"  {name}: GiB allocated after each step: {held}", flush=True)
    if not cfg.compare:
        return row, None
    # the parameters go to host memory: a device copy per row would sit in every later row's peak memory
    weights = {k: v.detach().to("cpu", copy=True) for k, v in work.actor.state_dict().items()}
    snapshot = _Snapshot(weights, optimizer_fingerprints(roles.optimizer), trail)
    if work.updates is not None:
        try:
            work.updates.record(name, roles.optimizer, row)
        except Exception as err:  # the row's times stand without the comparison
            row["update_error"] = f"{type(err).__name__}: {err}"
    if work.device.type == "cuda":
        torch.cuda.empty_cache()  # the fingerprints' temporaries stay out of the next row's memory
    return row, snapshot


class Updates:
    """Each row's update, its FP32 master weights minus the initial weights: kept on the host (FP32, the
    size of the masters) for the rows that are another row's baseline, and for the other rows compared
    with their baseline's as they finish, as ``update_rel_diff_vs_serial`` = ‖u − u_base‖₂ / ‖u_base‖₂
    over every parameter (0 for the same update; serial-again against serial gives one sample of
    serial's own run-to-run difference). A row is compared only when its baseline ran before it, with
    as many steps. Kept updates sit in host memory (4 bytes per parameter each).

    Args:
        initial: the initial weights by parameter name (any float dtype; the masters started from them).
        names: parameter name by ``id`` of each trained parameter.
        rows: the rows the bench will run, in order.
    """

    def __init__(self, initial: dict[str, torch.Tensor], names: dict[int, str], rows: tuple[str, ...]):
        self.initial, self.names = initial, names
        self.needed = {BASELINES[r] for r in rows}
        self.kept: dict[str, tuple[int, list[torch.Tensor]]] = {}

    def _updates(self, optimizer):
        for index, name, master in optimizer.state_tensors():
            if name == "master":
                initial = self.initial[self.names[id(optimizer.params[index])]]
                master = master.detach().to(optimizer.device)
                yield master - initial.to(master.device, torch.float32)

    def record(self, name: str, optimizer, row: dict) -> None:
        """Compare the finished row's update with its baseline's (``row`` gains the ratio) and keep it
        when another row will compare with it."""
        base_name = compared_with(name, row["steps_taken"], {n: s for n, (s, _) in self.kept.items()})
        base = self.kept[base_name][1] if base_name is not None else None
        keep = name in self.needed
        stored, diff, ref = [], 0.0, 0.0
        for i, update in enumerate(self._updates(optimizer)):
            if base is not None:
                b = base[i].to(update.device, non_blocking=True)
                diff += float(torch.linalg.vector_norm(update - b, dtype=torch.float64)) ** 2
                ref += float(torch.linalg.vector_norm(b, dtype=torch.float64)) ** 2
            if keep:
                stored.append(_host_copy(update))
        if keep:
            self.kept[name] = (row["steps_taken"], stored)
        if base is not None:
            row["update_rel_diff_vs_serial"] = math.sqrt(diff / ref) if ref > 0 else math.nan


def compared_with(name: str, steps: int, ran: dict[str, int]) -> str | None:
    """The row whose update row ``name`` (``steps`` steps taken) is compared with: its baseline
    (``BASELINES``) when that is another row, among ``ran`` (steps taken by each row run before it),
    with as many steps; else None (auto's trials add steps)."""
    base = BASELINES[name]
    return base if base != name and ran.get(base) == steps else None


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (pageable: torch's pinned allocations round up to a power of two, and the
    host pool holds the runs' own pinned memory)."""
    return tensor.to("cpu", copy=True)


def _largest(norms: list[float]) -> float:
    """A step's largest gradient norm; inf when one is not finite (its update was skipped)."""
    return max(norms) if all(math.isfinite(n) for n in norms) else math.inf


@dataclass
class _Snapshot:
    """What a row's update left: the model's weights (host copies) and its optimizer's fingerprints."""

    weights: dict[str, torch.Tensor]
    fingerprints: dict[tuple[int, str], int]
    steps: list[dict[str, int]]  # bench.fingerprint.step_fingerprints of every step, warm-up included


def _summarise(rows: dict, tokens: int, roofline_s: float) -> None:
    """Speedup and saving over serial, and decode seconds per step against the roofline, per row
    (standalone decode time T_D over the decode steps; ``tokens`` − 1 where a row does not count them)."""
    for name, row in rows.items():
        if "error" in row:
            continue
        serial = rows.get(BASELINES[name], {}).get("step_s_median")
        if serial is not None:
            row["speedup_vs_serial"] = serial / row["step_s_median"]
            row["saving_vs_serial_s"] = serial - row["step_s_median"]
        per_step = row.get("eq1/T_D", float("nan")) / max(1, row.get("eq1/decode_steps", tokens - 1))
        row["decode_ms_per_step"] = per_step * 1e3
        row["decode_roofline_ratio"] = per_step / roofline_s


def run_schedule_bench(cfg: ScheduleBenchConfig, out: Path | None = None) -> ScheduleBenchResult:
    """Run every row of ``cfg.rows`` and print the table.

    Raises:
        ValueError: an unknown or repeated row name, or a preset other than ``tiny`` without a CUDA
            device.
    """
    unknown = set(cfg.rows) - set(ROWS)
    if unknown:
        raise ValueError(f"unknown schedule rows {sorted(unknown)}; expected some of {list(ROWS)}")
    repeated = sorted({name for name in cfg.rows if cfg.rows.count(name) > 1})
    if repeated:
        raise ValueError(f"schedule rows given more than once: {repeated} (serial-again repeats serial)")
    if world_size() > 1:  # under torchrun: every process its shard of each row
        _checked_overrides(cfg.overrides)
        return run_parallel_schedule_bench(cfg, out, row_config, ScheduleBenchResult)
    alone = sorted(set(cfg.rows) & set(TORCHRUN_ROWS))
    if alone:
        raise ValueError(f"schedule rows {alone} need several processes: run rollplex bench under torchrun")
    overridden = _checked_overrides(cfg.overrides)
    if cfg.deterministic or overridden.run.deterministic:
        use_deterministic_algorithms()  # before the workload's first product (see its docstring)
    device = bench_device(cfg.preset)
    work = _Workload(cfg, device)
    names = {id(p): n for n, p in work.actor.named_parameters()}
    if cfg.compare:
        work.updates = Updates(work.initial, names, cfg.rows)
    # one pinned host pool for every row, as large as the largest row's plan needs (pinned once)
    pools = [work.plan(row_config(ROWS[name], cfg, work.sms)).host_pool_bytes for name in cfg.rows]
    work.pool = PinnedHostPool(max(pools, default=0))
    result = ScheduleBenchResult(config=asdict(cfg))
    result.host_pool_pin_s = work.pool.pin_seconds
    snapshots = {}
    for name in cfg.rows:
        _free_previous_row(device)
        try:
            result.rows[name], snapshot = _timed_row(work, name, cfg)
            if snapshot is not None:
                snapshots[name] = snapshot
        except torch.OutOfMemoryError as err:  # one row out of memory must not hide the others
            print(f"  {name}: out of memory: {err}", flush=True)
            result.rows[name] = {"error": "out of memory"}
            torch.cuda.empty_cache()
        except Exception as err:  # nor one that fails (a kernel that does not compile, say)
            print(f"  {name}: failed: {type(err).__name__}: {err}", flush=True)
            result.rows[name] = {"error": f"{type(err).__name__}: {err}"}
        _write(result, out)  # after every row, so a run cut short keeps what it measured
    ran: dict[str, int] = {}
    for name, snap in snapshots.items():  # in the order the rows ran (each once)
        row, base = result.rows[name], BASELINES[name]
        if base != name and base in result.rows:
            row["baseline"] = base
            if compared_with(name, row["steps_taken"], ran) is None:
                row["not_compared"] = _why_not_compared(row, result.rows[base], base in ran)
            else:
                _compare(row, snap, snapshots[base])
        ran[name] = row["steps_taken"]
    bytes_per_step = step_bytes(
        work.actor, [p.length for p in work.prompts], cfg.group_size, cfg.response_tokens
    )
    result.copy_bandwidth_gbps = copy_bandwidth(device)
    _summarise(result.rows, cfg.response_tokens, bytes_per_step / (result.copy_bandwidth_gbps * 1e9))
    _print(result)
    _write(result, out)
    return result


# what the benchmark sets itself (its workload options) or does not have (a run folder, a dataset)
_WORKLOAD_KEYS = ("rollout.group_size", "rollout.prompts_per_step", "rollout.max_response_tokens")
_NOT_READ = ("model.path", "model.preset", "model.freeze_vision", "model.gradient_checkpointing")


def _checked_overrides(overrides: tuple[str, ...]) -> Config:
    """The defaults with ``overrides`` applied (checked as ``rollplex train`` checks them).

    Raises:
        ConfigError (ValueError): a bad override, or one of a field the benchmark gives no effect: its
            workload shape (``--groups``, ``--group-size``, ``--response-tokens``), the run, data and
            eval sections (but ``run.deterministic``), and the model's path and training settings.
    """
    config = load_config(None, overrides)
    for item in overrides:
        key = item.partition("=")[0].strip()
        section = key.split(".")[0]
        unread = section in ("run", "data", "eval") and key != "run.deterministic"
        if unread or key in _WORKLOAD_KEYS or key in _NOT_READ:
            raise ConfigError(
                f"rollplex bench schedule: {key} takes no effect in the benchmark, which builds its own "
                "model and prompts (--preset, --groups, --group-size, --response-tokens, --dtype) and "
                "writes no run folder"
            )
    return config


def _free_previous_row(device: torch.device) -> None:
    """Free what the previous row left: its roles (an optimizer's FP32 state is 12 bytes per parameter)
    may sit in reference cycles until Python's collector runs, which would leave the next row short of
    memory, enough to run it out of memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _why_not_compared(row: dict, base: dict, base_ran_before: bool) -> str:
    """Why a row's update was not compared with its baseline row's (``base``, named in the row)."""
    name = row["baseline"]
    if "error" in base:
        return f"{name} failed"
    if not base_ran_before:
        return f"{name} ran after it"
    return f"{row['steps_taken']} steps against {name}'s {base['steps_taken']}"


def _compare(row: dict, snap: _Snapshot, base: _Snapshot) -> None:
    """The row's largest bf16 weight difference from its baseline row (``max_abs_param_diff_vs_serial``),
    how many of the optimizer's FP32 tensors (master weights, AdamW moments) differ from the baseline's
    (``optimizer_tensors_differing``, 0: the same update, bitwise) out of how many
    (``optimizer_tensors``), and per fingerprinted value the first step that differs
    (``first_step_differing``, 1-based, None where none does)."""
    w, b = snap.weights, base.weights
    row["max_abs_param_diff_vs_serial"] = max(float((w[k].float() - b[k].float()).abs().max()) for k in w)
    row["optimizer_tensors_differing"] = differing(snap.fingerprints, base.fingerprints)
    row["optimizer_tensors"] = len(snap.fingerprints.keys() | base.fingerprints.keys())
    row["first_step_differing"] = first_difference(snap.steps, base.steps)


def _write(result: ScheduleBenchResult, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(result), indent=2))


def _print(result: ScheduleBenchResult) -> None:
    keys = [
        "step_s_median",
        "step_s_spread",
        "speedup_vs_serial",
        "eq1/phase1",
        "eq1/T_D",
        "eq1/T_P",
        "eq1/delta_D",
        "eq1/S",
        "eq1/bound",
        "eq1/T_post",
        "decode/setup_s",
        "grad_norm",
        "decode_ms_per_step",
        "decode_roofline_ratio",
        "peak_memory_gib",
        "memory/predicted_peak_gib",
        "memory/moved_gib",
        "host_pool_gib",
        "alloc_retries",
        "device_allocs",
        "max_abs_param_diff_vs_serial",
        "update_rel_diff_vs_serial",
        "optimizer_tensors_differing",
    ]
    keys = [k for k in keys if any(k in row for row in result.rows.values())]
    print(f"copy bandwidth {result.copy_bandwidth_gbps:.0f} GB/s")
    print(f"{'schedule':20} " + " ".join(f"{k.removeprefix('eq1/'):>12}" for k in keys))
    for name, row in result.rows.items():
        if "error" in row:
            print(f"{name:20} {row['error']}")
            continue
        print(f"{name:20} " + " ".join(f"{row.get(k, float('nan')):12.4g}" for k in keys))
    for name, row in result.rows.items():
        if "baseline" in row:
            print(f"{name}: {verdict(row)}")
        if "auto_policy" in row:
            trials = ", ".join(f"{p} {t:.3f} s" for p, t in row["auto_trials_span_s"].items())
            print(f"{name}: median decode/prefix span per policy: {trials}; kept {row['auto_policy']}")
        elif "auto_trials_left" in row:
            print(f"{name}: {row['auto_trials_left']} trial(s) left after its steps: no policy kept")


def verdict(row: dict) -> str:
    """One line on whether a row's update was its baseline's (``row["baseline"]``): the same bitwise
    (every FP32 tensor of the optimizer, and every step's fingerprinted values), where it differs, or
    why the two were not compared (``row["not_compared"]``)."""
    name = row["baseline"]
    if "optimizer_tensors_differing" not in row:
        return f"not compared with {name}: {row['not_compared']}"
    differ, total = row["optimizer_tensors_differing"], row["optimizer_tensors"]
    steps = row["first_step_differing"]  # fingerprinted value -> first step differing, or None
    parted = ", ".join(  # earliest first
        f"{key} at step {step}" for key, step in sorted(steps.items(), key=lambda kv: kv[1] or 0) if step
    )
    if differ == 0 and not parted:
        return (
            f"the same update as {name}, bitwise: {total} FP32 tensors, and every step's {', '.join(steps)}"
        )
    return f"differs from {name} in {differ} of {total} FP32 optimizer tensors" + (
        f"; first in {parted}" if parted else ""
    )

"""A run's memory: its plan, the device budget it enforces, and the residency manager, chunked optimizer
and saved-tensor offload built from the plan (paper §3.2). ``loop.train`` and ``rollplex bench`` both set
up their memory here, so a benchmark row runs exactly what a training run runs.

Order at start-up (``loop.train``):

    plan = plan_run(cfg, device)            # shapes only: before anything loads
    refuse_unless_fits(plan)                # before step 1, naming the shortfall and the setting
    enforce_budget(plan, device)            # the caching allocator may not exceed the budget
    ... models load ...
    memory = build_memory(plan, cfg, device, actor, reference)
    Roles(..., optimizer=memory.optimizer, residency=memory.residency, offload=memory.offload)

Each step the schedules call ``phases.enter_window`` at the window boundaries (memory.windows) and
``phases.end_step`` at the end; ``step_metrics(memory)`` gives the step's ``memory/*`` metrics.

Example:
    plan = plan_run(cfg, torch.device("cuda"))
    print(plan.table())                     # what lives where in each window, GiB per GPU
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import torch

from rollplex.config import Config
from rollplex.memory import saved_offload
from rollplex.memory.chunked_adamw import ChunkedAdamW
from rollplex.memory.host_pool import PinnedHostPool
from rollplex.memory.plan_command import PlanInputs, plan_config
from rollplex.memory.planner import GIB, MemoryPlan
from rollplex.memory.residency import Residency
from rollplex.memory.saved_offload import SavedTensorOffload

log = logging.getLogger("rollplex")


@dataclasses.dataclass
class MemoryRuntime:
    """What ``build_memory`` sets up for a run, and the step counters of ``step_metrics``.

    Attributes:
        plan: the plan it applies.
        residency: the one owner of the host pool, the transfer streams, paging and counters.
        optimizer: the chunked optimizer over the actor's trainable parameters.
        offload: the actor prefixes' saved-tensor offload (None where the plan keeps them on the device).
        moved_before: bytes moved host<->device before the current step (``step_metrics``).
    """

    plan: MemoryPlan
    residency: Residency
    optimizer: ChunkedAdamW
    offload: SavedTensorOffload | None
    moved_before: int = 0


def plan_run(cfg: Config, device: torch.device, inputs: PlanInputs | None = None) -> MemoryPlan:
    """The memory plan of ``cfg`` on ``device`` (``memory.plan_command.plan_config``). On a device other
    than CUDA nothing bounds the device: the plan keeps everything resident unless the ``memory:``
    settings force a move (``on`` / ``paged``), which runs the same code paths on the CPU.

    Raises:
        ValueError: the model's shapes cannot be read (``plan_command.architecture``) or a parallel degree
            the model cannot take.
    """
    inputs = inputs or PlanInputs()
    if device.type != "cuda" and inputs.device_gib is None:
        inputs = dataclasses.replace(inputs, device_gib=math.inf)
    plan, _ = plan_config(cfg, inputs)
    return plan


def refuse_unless_fits(plan: MemoryPlan) -> None:
    """Stop a run that cannot fit before its first step.

    Raises:
        ValueError: ``plan.fits`` is False; the message gives the shortfall in GiB and the settings that
            would make it fit (``MemoryPlan.advice``).
    """
    if not plan.fits:
        raise ValueError(
            f"the run does not fit: planned peak {plan.planned_peak_gib:.1f} GiB against a budget of "
            f"{plan.budget_gib:.1f} GiB per GPU ({plan.shortfall_gib:.1f} GiB short): {plan.advice} "
            "(rollplex plan CONFIG shows what lives where)"
        )


def enforce_budget(budget_gib: float, device: torch.device) -> float:
    """Cap the caching allocator of ``device`` at ``budget_gib`` (``torch.cuda.set_per_process_memory_fraction``:
    an allocation past it first frees cached blocks and retries, then raises out-of-memory), as on a card
    of that size. No-op off CUDA or for a budget at or above the device's capacity.

    Returns:
        The fraction of the device's memory set (1.0 when none).
    """
    if device.type != "cuda" or not math.isfinite(budget_gib):
        return 1.0
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, budget_gib * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def build_memory(
    plan: MemoryPlan,
    cfg: Config,
    device: torch.device,
    actor: torch.nn.Module,
    reference: torch.nn.Module | None,
    pool: PinnedHostPool | None = None,
    make_optimizer: Callable | None = None,
) -> MemoryRuntime:
    """The residency manager, chunked optimizer and saved-tensor offload that apply ``plan``: the
    reference paged where the plan pages it, the actor prefixes' saved tensors offloaded where it
    offloads them, the first chunks of optimizer state (``plan.optimizer_host_bytes``) in the host pool.

    Args:
        pool: a host pool to use instead of allocating the plan's (``rollplex bench`` keeps one for all
            rows); it must hold ``plan.host_pool_bytes``.
        make_optimizer: ``(pool, transfers, host_bytes) -> optimizer`` in place of the one-process
            ``ChunkedAdamW`` (a parallel run's ZeRO-1 optimizer, parallel.runtime).
    """
    residency = Residency.from_plan(plan, device, pool=pool)
    if reference is not None and plan.reference_paging == "paged":
        residency.page("reference", reference)
    offload = None
    if plan.offload_activations:
        offload = residency.saved_offload(
            actor, plan.activation_arena_bytes, min_bytes=saved_offload.MIN_OFFLOAD_BYTES
        )
    if make_optimizer is not None:
        optimizer = make_optimizer(residency.pool, residency.transfers, plan.optimizer_host_bytes)
    else:
        optimizer = ChunkedAdamW.for_model(
            actor,
            cfg.optim,
            chunk_mib=cfg.memory.chunk_mib,
            host_bytes=plan.optimizer_host_bytes,
            pool=residency.pool,
            transfers=residency.transfers,
        )
    residency.track_optimizer(optimizer)
    _track_models(residency, actor, reference)
    log.info(
        "memory: optimizer state %.1f%% in the host pool, reference %s, prefix activations %s; host pool "
        "%.2f GiB; planned peak %.1f of %.1f GiB",
        100 * plan.optimizer_host_fraction,
        plan.reference_paging,
        "offloaded" if offload is not None else "on the device",
        residency.pool.nbytes / GIB,
        plan.planned_peak_gib,
        plan.budget_gib,
    )
    return MemoryRuntime(plan, residency, optimizer, offload)


def _bytes_on(tensors, device: torch.device) -> int:
    return sum(
        t.untyped_storage().nbytes() for t in tensors if t is not None and t.device.type == device.type
    )


def _track_models(residency: Residency, actor: torch.nn.Module, reference: torch.nn.Module | None) -> None:
    """Probes of the classes the models hold: the BF16 snapshot, its gradients, a resident reference."""
    device, params = residency.device, [p for p in actor.parameters()]
    snapshot = {p.untyped_storage().data_ptr(): p for p in params}.values()  # each storage once
    residency.track("snapshot", lambda: {"device": _bytes_on(snapshot, device), "host": 0})
    residency.track("grads", lambda: {"device": _bytes_on((p.grad for p in params), device), "host": 0})
    if reference is not None and "reference" not in residency.pages:
        held = list({p.untyped_storage().data_ptr(): p for p in reference.parameters()}.values())
        residency.track("reference", lambda: {"device": _bytes_on(held, device), "host": 0})


def step_metrics(memory: MemoryRuntime) -> dict[str, float]:
    """The step's ``memory/*`` metrics: the plan's predicted peak (GiB per GPU, beside the measured
    ``peak_memory_gib``), the host pool, the bytes moved between host and device during the step (GiB),
    and, with activation offload, what the offload moved and what stayed on the device because the
    arena was full (GiB)."""
    moved = sum(m["h2d"] + m["d2h"] for m in memory.residency.transfers.moved.values())
    out = {
        "memory/predicted_peak_gib": memory.plan.planned_peak_gib,
        "memory/host_pool_gib": memory.residency.pool.nbytes / GIB,
        "memory/moved_gib": (moved - memory.moved_before) / GIB,
    }
    memory.moved_before = moved
    if memory.offload is not None:
        out["memory/offloaded_gib"] = memory.offload.last_step["offloaded"] / GIB
        out["memory/offload_overflow_gib"] = memory.offload.last_step["overflow"] / GIB
    return out

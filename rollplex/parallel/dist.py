"""SPMD process layout under torchrun: ranks, process groups, the writer rank, failures named by rank.

One process per GPU hosts rollout, reference and actor, and every process runs the same program.
``init_parallel`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), starts the
default process group (NCCL on CUDA, gloo on the CPU) and builds the groups below from the
``parallel:`` config section. Without torchrun (no ``WORLD_SIZE``, or 1) the same program runs as
world 1 with no process group at all: every ``Comm`` has size 1 and its collectives are no-ops.

Rank arithmetic (colocated; D = parallel.dp, T = tp_train, Tr = tp_rollout, q = T / Tr):

    training TP groups   D groups of T consecutive ranks: {d·T, …, d·T + T − 1}; tp rank t = rank mod T
    share groups         inside each training group, the q consecutive ranks {d·T + r·q + j : j < q}
    rollout TP groups    inside each training group, q groups of stride q: {d·T + j + k·q : k < Tr}
    data-parallel groups ranks with the same tp rank across replicas: {t + d·T : d < D}

Why rollout groups are strided: the column/vocabulary layout (parallel.layout) puts training shard t at
rows [t·n/T, (t+1)·n/T), so the q consecutive training shards r·q … r·q + q − 1 together are exactly
rows [r·n/Tr, (r+1)·n/Tr), rollout shard r. A GPU with training rank t holds training shard t, which
lies inside rollout shard ⌊t/q⌋ and nowhere else, so its rollout rank must be k = ⌊t/q⌋. A rollout
group needs one GPU of each rollout rank 0 … Tr − 1, hence the ranks t = j + k·q for one offset
j < q; the q GPUs that hold pieces of the same rollout shard (same k) are t = k·q + j, j < q:
consecutive, the share group, which all-gathers the pieces in place after each update
(parallel.weight_sharing). So a training replica of T GPUs decodes as q rollout engines of Tr GPUs
each (rollout data parallelism D·q).

Disaggregated: the first D·T ranks train (groups as above, without share groups) and the last
``parallel.rollout_gpus`` ranks only decode, in consecutive rollout TP groups of Tr; global rank 0,
which writes logs and checkpoints, is a training rank.

Failures (``guard``): a failing process exits non-zero and torchrun's agent then stops every other
worker of the job; with the entry point wrapped in ``torch.distributed.elastic.multiprocessing.errors
.record`` its report names the first failed rank and its traceback. That is the backstop, and the only
way out of a rank stuck in a collective its peer never reached. For errors raised between
collectives (a bad record, a missing file on one node), ``guard`` around each phase all-reduces a
failure flag at the phase's end, so every rank stops at the same boundary: the failed rank re-raises
its own error and the others raise ``RankFailure`` naming it.

Where the run uses them: ``loop.train`` calls ``init_parallel(cfg.parallel)`` first, then
``configure_logging``, ``check_parallel`` with the model's config, and ``close_parallel`` at the end;
it writes logs, metrics, the trace and checkpoints only where ``ctx.is_writer`` and puts ``guard``
around set-up, each step, evaluation and each stage of a checkpoint (the phases inside a step differ
between the training and the rollout ranks of a disaggregated run, so the step is the finest boundary
every rank shares).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rollplex.config import ConfigError, ParallelConfig
from rollplex.parallel.layout import undivided_size

log = logging.getLogger("rollplex")

COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # room for rank 0 writing a checkpoint while the others wait
# how long a failed rank waits at ``guard`` for the others before it exits anyway (they may be held in a
# collective it never reached; its exit then lets torchrun's agent end them)
GUARD_WAIT = timedelta(minutes=2)


@dataclass(frozen=True)
class RankLayout:
    """The groups of every rank for one ``parallel:`` setting and world size: plain rank arithmetic,
    no torch.distributed (see the module docstring for the rules).

    Each family is a tuple of groups, each group a tuple of global ranks in group-rank order.

    Example (world 4, dp 1, tp_train 4, tp_rollout 2, colocated):
        train_tp = ((0, 1, 2, 3),)       rollout_tp = ((0, 2), (1, 3))
        share = ((0, 1), (2, 3))          dp = ((0,), (1,), (2,), (3,))
    """

    world: int
    dp: int
    tp_train: int
    tp_rollout: int
    rollout_gpus: int = 0

    @property
    def q(self) -> int:
        """Training shards per rollout shard, tp_train / tp_rollout."""
        return self.tp_train // self.tp_rollout

    @property
    def training_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.dp * self.tp_train))

    @property
    def rollout_ranks(self) -> tuple[int, ...]:
        """Ranks that decode: every rank when colocated, the last ``rollout_gpus`` when disaggregated."""
        if not self.rollout_gpus:
            return tuple(range(self.world))
        return tuple(range(self.world - self.rollout_gpus, self.world))

    def pools(self) -> tuple[tuple[int, ...], ...]:
        """Colocated: one pool, every rank; disaggregated: the training ranks, then the rollout ranks."""
        if not self.rollout_gpus:
            return (tuple(range(self.world)),)
        return self.training_ranks, self.rollout_ranks

    def train_tp(self) -> tuple[tuple[int, ...], ...]:
        t = self.tp_train
        return tuple(tuple(range(d * t, d * t + t)) for d in range(self.dp))

    def share(self) -> tuple[tuple[int, ...], ...]:
        """Colocated only (empty when disaggregated: rollout holds its own copy there)."""
        if self.rollout_gpus:
            return ()
        q = self.q
        return tuple(tuple(base + r * q + j for j in range(q)) for base, r in self._replica_shards())

    def rollout_tp(self) -> tuple[tuple[int, ...], ...]:
        if self.rollout_gpus:
            first, tr = self.world - self.rollout_gpus, self.tp_rollout
            return tuple(tuple(range(first + i, first + i + tr)) for i in range(0, self.rollout_gpus, tr))
        q = self.q
        bases = range(0, self.dp * self.tp_train, self.tp_train)
        return tuple(tuple(b + j + k * q for k in range(self.tp_rollout)) for b in bases for j in range(q))

    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        t = self.tp_train
        return tuple(tuple(r + d * t for d in range(self.dp)) for r in range(t))

    def _replica_shards(self) -> Iterator[tuple[int, int]]:
        for base in range(0, self.dp * self.tp_train, self.tp_train):
            for r in range(self.tp_rollout):
                yield base, r


def layout_of(parallel: ParallelConfig, world: int) -> RankLayout:
    """The ``RankLayout`` of a checked ``parallel`` section (``check_world``) in a world of ``world``."""
    return RankLayout(world, parallel.dp, parallel.tp_train, parallel.tp_rollout, parallel.rollout_gpus)


def check_world(parallel: ParallelConfig, world: int) -> None:
    """The GPU count torchrun started must be what ``parallel`` asks for.

    Raises:
        ConfigError: colocated and dp × tp_train ≠ world, or disaggregated and dp × tp_train +
            rollout_gpus ≠ world; the message names the fields and WORLD_SIZE.
    """
    need = parallel.dp * parallel.tp_train + parallel.rollout_gpus
    if need != world:
        extra = f" + parallel.rollout_gpus={parallel.rollout_gpus}" if parallel.rollout_gpus else ""
        raise ConfigError(
            f"parallel.dp={parallel.dp} × parallel.tp_train={parallel.tp_train}{extra} = {need} GPUs, but "
            f"WORLD_SIZE={world} processes were started (torchrun --nproc-per-node × nodes)"
        )


def check_heads(parallel: ParallelConfig, text_config) -> None:
    """Tensor-parallel degrees against the language model's sizes (attention / key-value heads in the
    published config.json of Qwen2.5-VL-3B/7B/32B-Instruct: 16/2, 28/4, 40/8). Each degree must divide the attention heads, the key/value heads, the MLP width and
    the vocabulary; the vision tower is replicated on every rank, so its sizes (MLP width 3420 is not
    divisible by 8) do not limit the degree.

    Raises:
        ConfigError: naming parallel.tp_train or parallel.tp_rollout and the size it does not divide;
            a degree above the key/value head count is refused (serving engines replicate key/value
            heads there; rollplex does not support that).
    """
    c = text_config
    for name in ("tp_train", "tp_rollout"):
        tp = getattr(parallel, name)
        if tp > c.num_key_value_heads:
            raise ConfigError(
                f"parallel.{name}={tp} exceeds the model's {c.num_key_value_heads} key/value heads: each rank "
                "must own whole key/value heads (replicating key/value heads across ranks, as serving engines "
                "do, is not supported)"
            )
        undivided = undivided_size(c, tp)
        if undivided is not None:
            raise ConfigError(
                f"parallel.{name}={tp} does not divide the model's {undivided[0]}, {undivided[1]}"
            )


def check_groups(parallel: ParallelConfig, prompts_per_step: int) -> None:
    """Each rollout engine decodes whole prompt groups: dp × q engines share rollout.prompts_per_step.

    Raises:
        ConfigError: rollout.prompts_per_step is not a multiple of the number of rollout engines.
    """
    engines = parallel.dp * (parallel.tp_train // parallel.tp_rollout)
    if parallel.rollout_gpus:
        engines = parallel.rollout_gpus // parallel.tp_rollout
    if prompts_per_step % engines:
        raise ConfigError(
            f"rollout.prompts_per_step={prompts_per_step} conflicts with the {engines} rollout engines of "
            f"parallel (dp={parallel.dp}, tp_train={parallel.tp_train}, tp_rollout={parallel.tp_rollout}, "
            f"rollout_gpus={parallel.rollout_gpus}): each engine decodes whole prompt groups"
        )


def check_parallel(parallel: ParallelConfig, world: int, text_config, prompts_per_step: int) -> None:
    """All start-up checks of ``parallel`` (``check_world``, ``check_heads``, ``check_groups``).

    Raises:
        ConfigError: see those functions.
    """
    check_world(parallel, world)
    check_heads(parallel, text_config)
    check_groups(parallel, prompts_per_step)


@dataclass(frozen=True, eq=False)
class Comm:
    """One process group seen from one rank: its global ranks (in group-rank order), this rank's index
    and the torch ProcessGroup (None when the group has one rank: every collective is then a no-op, and
    a world-1 run never touches torch.distributed).

    Deep copies share the group (a ProcessGroup cannot be copied), so a model holding one can be copied.
    """

    ranks: tuple[int, ...]
    rank: int
    group: object | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __deepcopy__(self, memo) -> Comm:
        return self

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (``op`` "sum" or "max") of ``tensor``; returns it."""
        assert op in ("sum", "max"), op
        if self.size > 1:
            reduce = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
            dist.all_reduce(tensor, op=reduce, group=self.group)
        return tensor

    def all_gather_into(self, out: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
        """``out`` (contiguous, size × the elements of ``piece``) ← every rank's ``piece`` in group-rank
        order, e.g. [size·n, …] from [n, …]. In place when ``piece`` is this rank's slice of ``out``
        (NCCL documents this; gloo copies through a buffer)."""
        if self.size == 1:
            if piece.data_ptr() != out.data_ptr():
                out.copy_(piece)
            return out
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), piece.reshape(-1), group=self.group)  # flat: the concatenation form
        return out


SOLO = Comm((0,), 0)  # the group of a one-process run


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """This process's place in the run.

    Fields: ``rank``/``world`` (global), ``local_rank`` (GPU index on its node), ``device``,
    ``layout`` (RankLayout), and the groups as ``Comm``s: ``world_comm``, ``train_tp``, ``rollout_tp``,
    ``share`` (the q ranks whose training shards form one rollout shard), ``dp``, ``pool`` (the ranks
    that run the same phases as this one: every rank when colocated; when disaggregated, the training
    ranks or the rollout ranks: decode's early stop and the metrics reduce over it), ``watch`` (every
    rank, a group of its own that only ``guard`` uses, so a guard's collective can never pair with
    another collective a failed rank left behind). Groups this rank is not a member of (a rollout-only
    rank's ``train_tp``) are ``SOLO``-like size-1 Comms.
    """

    rank: int
    world: int
    local_rank: int
    device: torch.device
    layout: RankLayout
    world_comm: Comm
    train_tp: Comm
    rollout_tp: Comm
    share: Comm
    dp: Comm
    pool: Comm = SOLO
    watch: Comm = SOLO
    owns_group: bool = False  # init_parallel started the default group (close_parallel stops it)

    @property
    def is_writer(self) -> bool:
        """Only global rank 0 writes logs, metrics and checkpoints."""
        return self.rank == 0

    @property
    def trains(self) -> bool:
        return self.rank in self.layout.training_ranks

    @property
    def decodes(self) -> bool:
        return self.rank in self.layout.rollout_ranks


def _family(groups: tuple[tuple[int, ...], ...], rank: int, distributed: bool) -> Comm:
    """This rank's Comm in a family of disjoint groups. Every rank must call it for every family in the
    same order (torch.distributed creates groups collectively); size-1 families create no group."""
    mine = next((g for g in groups if rank in g), (rank,))
    if not distributed or max((len(g) for g in groups), default=1) == 1:
        return Comm(mine, mine.index(rank))
    group, _ = dist.new_subgroups_by_enumeration([list(g) for g in groups])
    return Comm(mine, mine.index(rank), group if len(mine) > 1 else None)


def build_context(parallel: ParallelConfig, rank: int, world: int, device: torch.device) -> ParallelContext:
    """The ``ParallelContext`` of ``rank`` for ``parallel``; creates the process groups when the default
    group is initialised (every rank must call it, with the same settings). Tests call it several times
    in one world with different settings.

    Raises:
        ConfigError: ``parallel`` does not fit ``world`` (``check_world``).
    """
    check_world(parallel, world)
    layout = layout_of(parallel, world)
    on = world > 1 and dist.is_available() and dist.is_initialized()  # world 1: no torch.distributed call
    everyone = (tuple(range(world)),)
    world_comm = Comm(everyone[0], rank, dist.group.WORLD if on else None)
    watch = Comm(everyone[0], rank, dist.new_group(list(everyone[0])) if on else None)
    pool = world_comm if len(layout.pools()) == 1 else _family(layout.pools(), rank, on)
    return ParallelContext(
        rank=rank,
        world=world,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        device=device,
        layout=layout,
        world_comm=world_comm,
        train_tp=_family(layout.train_tp(), rank, on),
        rollout_tp=_family(layout.rollout_tp(), rank, on),
        share=_family(layout.share(), rank, on),
        dp=_family(layout.dp_groups(), rank, on),
        pool=pool,
        watch=watch,
    )


def init_parallel(parallel: ParallelConfig, *, init_method: str | None = None) -> ParallelContext:
    """Start this process's part of the run from torchrun's environment.

    ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` come from torchrun (absent: world 1, no process group).
    With CUDA the process takes GPU ``LOCAL_RANK`` and NCCL; without, gloo on the CPU. ``init_method``
    defaults to torchrun's ``env://`` rendezvous (tests pass a ``file://`` one).

    Raises:
        ConfigError: the world size does not match ``parallel`` (``check_world``), before any group starts.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    check_world(parallel, world)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        if world > 1:
            torch.cuda.set_device(local)
    owns = world > 1 and not dist.is_initialized()
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            rank=rank,
            world_size=world,
            timeout=COLLECTIVE_TIMEOUT,
        )
    return dataclasses.replace(build_context(parallel, rank, world, device), owns_group=owns)


def close_parallel(ctx: ParallelContext) -> None:
    """End of the run: wait for every rank, then stop the process groups (a process that exits with
    its groups still running can abort in their threads' teardown) where ``init_parallel`` started
    them (a caller that started its own, a test harness, keeps it). Nothing to do for world 1."""
    if ctx.world > 1 and dist.is_initialized():
        ctx.watch.all_reduce(torch.zeros(1, device=ctx.device))  # every rank is here
        if ctx.owns_group:
            dist.destroy_process_group()


def configure_logging(ctx: ParallelContext) -> None:
    """Ranks other than the writer log warnings and errors only, each line prefixed with its rank (on
    the "rollplex" logger's handlers and the root logger's, where ``logging.basicConfig`` puts them)."""
    if ctx.is_writer:
        return
    logger = logging.getLogger("rollplex")
    logger.setLevel(logging.WARNING)
    prefix = f"[rank {ctx.rank}] "
    for handler in (*logger.handlers, *logging.getLogger().handlers):
        handler.setFormatter(logging.Formatter(prefix + "%(levelname)s %(message)s"))


def _wait_for_flags(ctx: ParallelContext, flags: torch.Tensor) -> None:
    """The ranks' failure flags summed over ``ctx.watch`` into ``flags``; a rank that failed itself
    waits ``GUARD_WAIT`` at most (a timeout leaves ``flags`` as they were)."""
    if ctx.watch.size == 1:
        return
    work = dist.all_reduce(flags, group=ctx.watch.group, async_op=True)
    if not flags[ctx.rank]:
        work.wait()
        return
    try:
        work.wait(GUARD_WAIT)
    except RuntimeError:  # the others are held elsewhere: this rank's own error goes up regardless
        log.error("rank %d: the other ranks did not reach the guard within %s", ctx.rank, GUARD_WAIT)


class RankFailure(RuntimeError):
    """Another rank failed in the phase this rank just finished (raised by ``guard``)."""


@contextlib.contextmanager
def guard(ctx: ParallelContext, where: str) -> Iterator[None]:
    """Run a phase; at its end all ranks agree whether any of them failed (one all-reduce of a flag per
    rank), so they all stop at the same boundary.

    The failed rank re-raises its own exception; every other rank raises
    ``RankFailure`` naming the failed ranks and ``where``. An error inside a collective a peer never
    reaches cannot be caught here: the failed rank waits ``GUARD_WAIT`` at most for the others (they
    may be held in a collective it never reached), then raises anyway, and its exit lets torchrun's
    agent end the job (module docstring). The flags travel on ``ctx.watch``, a group nothing else
    uses.

    Raises:
        RankFailure: another rank raised inside the block.
    """
    if ctx.world == 1:  # one process: nothing to agree on
        yield
        return
    error: BaseException | None = None
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised below after the ranks agree
        error = err
    flags = torch.zeros(ctx.world, dtype=torch.int32, device=ctx.device)
    flags[ctx.rank] = int(error is not None)
    if error is not None:
        log.error("rank %d of %d failed in %s: %s", ctx.rank, ctx.world, where, error)
        _wait_for_flags(ctx, flags)
        raise error
    _wait_for_flags(ctx, flags)
    failed = [r for r in range(ctx.world) if flags[r]]
    if failed:
        raise RankFailure(f"{where}: rank {', '.join(map(str, failed))} failed (its log has the error)")

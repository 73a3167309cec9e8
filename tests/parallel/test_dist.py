"""Process layout: the groups' rank arithmetic, start-up checks with the fields named, world 1 without
torch.distributed, the groups' collectives on 4 processes, and failures named by rank."""

from __future__ import annotations

import pytest
import torch

from rollplex.config import ConfigError, ParallelConfig, load_config
from rollplex.models.presets import preset_config
from rollplex.parallel.dist import (
    RankFailure,
    RankLayout,
    check_groups,
    check_heads,
    check_world,
    close_parallel,
    guard,
    init_parallel,
)
from tests.parallel.common import context


def _partition(groups, ranks) -> None:
    members = [r for g in groups for r in g]
    assert sorted(members) == sorted(ranks), groups


@pytest.mark.parametrize(
    ("world", "dp", "tp", "tr"), [(8, 1, 8, 4), (8, 2, 4, 2), (8, 1, 8, 1), (4, 4, 1, 1)]
)
def test_colocated_groups_follow_the_shard_layout(world, dp, tp, tr):
    layout = RankLayout(world, dp, tp, tr)
    q = tp // tr
    for family in (layout.train_tp(), layout.rollout_tp(), layout.share(), layout.dp_groups()):
        _partition(family, range(world))
    for group in layout.train_tp():
        assert group == tuple(range(group[0], group[0] + tp))  # consecutive
    for group in layout.rollout_tp():
        # the GPU at training rank t holds training shard t, inside rollout shard t // q: its rollout rank
        assert [(r % tp) // q for r in group] == list(range(tr)), group
    for group in layout.share():
        assert len({(r % tp) // q for r in group}) == 1 and [r % q for r in group] == list(range(q))
    for group in layout.dp_groups():
        assert len({r % tp for r in group}) == 1 and len(group) == dp


def test_paper_layout_example():
    layout = RankLayout(8, 1, 8, 4)
    assert layout.rollout_tp() == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert layout.share() == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_disaggregated_split():
    layout = RankLayout(6, 2, 2, 1, rollout_gpus=2)
    assert layout.training_ranks == (0, 1, 2, 3) and layout.rollout_ranks == (4, 5)
    assert layout.train_tp() == ((0, 1), (2, 3)) and layout.rollout_tp() == ((4,), (5,))
    assert layout.share() == () and layout.dp_groups() == ((0, 2), (1, 3))


def test_config_section_checks_name_the_fields():
    assert load_config(None).parallel == ParallelConfig()
    with pytest.raises(ConfigError, match=r"parallel\.tp_train=4 conflicts with parallel\.tp_rollout=3"):
        load_config(None, ["parallel.tp_train=4", "parallel.tp_rollout=3"])
    with pytest.raises(ConfigError, match=r"parallel\.rollout_gpus=2 conflicts with parallel\.placement"):
        load_config(None, ["parallel.rollout_gpus=2"])
    with pytest.raises(ConfigError, match=r"parallel\.rollout_gpus=3 conflicts with parallel\.tp_rollout=2"):
        load_config(
            None,
            [
                "parallel.placement=disaggregated",
                "parallel.rollout_gpus=3",
                "parallel.tp_rollout=2",
                "parallel.tp_train=2",
            ],
        )
    with pytest.raises(ConfigError, match=r"parallel\.placement='mixed' is not one of"):
        load_config(None, ["parallel.placement=mixed"])


def test_prefill_fusion_only_where_rollout_decodes_in_the_training_layout():
    """The actor prefix's boundary KV has the training layout: prefill fusion is refused at load for
    tp_train != tp_rollout (naming both) and for the disaggregated placement; auto leaves it off there."""
    from rollplex.config import uses_prefill_fusion

    degrees = ["parallel.tp_train=4", "parallel.tp_rollout=2"]
    fused = ["schedule.kind=rollplex", "schedule.prefill_fusion=true"]
    with pytest.raises(ConfigError, match=r"parallel\.tp_train=4 conflicts with parallel\.tp_rollout=2"):
        load_config(None, [*degrees, *fused])
    apart = ["parallel.placement=disaggregated", "parallel.rollout_gpus=1"]
    with pytest.raises(
        ConfigError, match=r"schedule\.prefill_fusion=True conflicts with parallel\.placement"
    ):
        load_config(None, [*apart, *fused])
    assert not uses_prefill_fusion(load_config(None, [*degrees, "schedule.kind=auto"]))
    assert not uses_prefill_fusion(load_config(None, [*apart, "schedule.kind=auto"]))
    assert uses_prefill_fusion(load_config(None, ["schedule.kind=auto"]))
    assert uses_prefill_fusion(load_config(None, ["parallel.tp_train=2", "parallel.tp_rollout=2", *fused]))


def test_world_size_must_match():
    check_world(ParallelConfig(dp=2, tp_train=4, tp_rollout=2), 8)
    with pytest.raises(
        ConfigError, match=r"parallel\.dp=1 × parallel\.tp_train=2 = 2 GPUs, but WORLD_SIZE=4"
    ):
        check_world(ParallelConfig(tp_train=2), 4)
    disagg = ParallelConfig(dp=1, tp_train=2, placement="disaggregated", rollout_gpus=2)
    check_world(disagg, 4)
    with pytest.raises(ConfigError, match=r"rollout_gpus=2 = 4 GPUs, but WORLD_SIZE=3"):
        check_world(disagg, 3)


@pytest.mark.parametrize(
    ("preset", "tp", "ok"),
    [
        ("qwen2.5-vl-3b", 2, True),  # 16 / 2 heads; vision MLP 3420 does not limit (replicated)
        ("qwen2.5-vl-3b", 4, False),
        ("qwen2.5-vl-7b", 4, True),  # 28 / 4
        ("qwen2.5-vl-7b", 8, False),
        ("qwen2.5-vl-32b", 8, True),  # 40 / 8
        ("tiny-tp", 4, True),
        ("tiny", 4, False),
    ],
)
def test_degrees_against_head_counts(preset, tp, ok):
    text = preset_config(preset).text_config
    parallel = ParallelConfig(tp_train=tp, tp_rollout=tp)
    if ok:
        check_heads(parallel, text)
        return
    with pytest.raises(
        ConfigError, match=r"parallel\.tp_train=\d+ exceeds the model's \d+ key/value heads.*not supported"
    ):
        check_heads(parallel, text)


def test_degree_must_divide_the_heads():
    text = preset_config("qwen2.5-vl-7b").text_config  # 28 heads, 4 key/value heads
    with pytest.raises(
        ConfigError, match=r"parallel\.tp_train=3 does not divide the model's attention heads, 28"
    ):
        check_heads(ParallelConfig(tp_train=3, tp_rollout=3), text)


def test_rollout_engines_take_whole_groups():
    check_groups(ParallelConfig(dp=2, tp_train=4, tp_rollout=2), 8)  # 4 engines
    with pytest.raises(
        ConfigError, match=r"rollout\.prompts_per_step=6 conflicts with the 4 rollout engines"
    ):
        check_groups(ParallelConfig(dp=2, tp_train=4, tp_rollout=2), 6)


def test_one_process_without_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ctx = init_parallel(ParallelConfig())
    assert (ctx.rank, ctx.world, ctx.is_writer) == (0, 1, True)
    assert not torch.distributed.is_initialized()
    for comm in (ctx.train_tp, ctx.rollout_tp, ctx.share, ctx.dp, ctx.world_comm):
        assert comm.size == 1 and comm.group is None
        assert torch.equal(comm.all_reduce(torch.ones(2)), torch.ones(2))
    close_parallel(ctx)  # nothing to stop
    with pytest.raises(ConfigError, match="WORLD_SIZE=1"):
        init_parallel(ParallelConfig(tp_train=2))


def groups_reduce(dp: int, tp: int, tr: int) -> dict:
    ctx = context(tp, tr, dp)
    out = {}
    for name in ("train_tp", "rollout_tp", "share", "dp"):
        comm = getattr(ctx, name)
        out[name] = (comm.ranks, comm.rank, comm.all_reduce(torch.tensor([float(ctx.rank)])).item())
    return out


def test_groups_reduce_over_their_members(ranks):
    layout = RankLayout(4, 1, 4, 2)
    families = {"train_tp": layout.train_tp(), "rollout_tp": layout.rollout_tp(), "share": layout.share()}
    families["dp"] = layout.dp_groups()
    for rank, out in enumerate(ranks(4, groups_reduce, 1, 4, 2)):
        for name, (members, index, total) in out.items():
            assert members in families[name] and members[index] == rank
            assert total == sum(members), (rank, name)


def fail_on_rank(bad: int) -> str:
    ctx = context(1, 1, 4)
    with guard(ctx, "rollout"):
        if ctx.rank == bad:
            raise ValueError("a record on this rank is broken")
    return "fine"


def test_failure_stops_every_rank_naming_the_failed_one(ranks):
    with pytest.raises(AssertionError) as failed:
        ranks(4, fail_on_rank, 2)
    message = str(failed.value)
    assert "rank 2 of 4 failed" in message and "ValueError: a record on this rank is broken" in message
    for other in (0, 1, 3):
        assert f"rank {other} of 4 failed" in message
    assert message.count(f"{RankFailure.__name__}: rollout: rank 2 failed") == 3
    assert ranks(4, fail_on_rank, -1) == ["fine"] * 4  # the pool is still usable


def raise_on_rank_one() -> int:
    if torch.distributed.get_rank() == 1:
        raise RuntimeError("only rank 1")
    return 0


def test_harness_names_the_failed_rank(ranks):
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*RuntimeError: only rank 1"):
        ranks(2, raise_on_rank_one)

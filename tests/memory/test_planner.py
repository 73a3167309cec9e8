"""The memory planner against hand counts on a toy architecture: every component's bytes, the window
totals, the naive sum, the order of the moves, the refusal, the host pool size."""

from __future__ import annotations

import dataclasses
import math

import pytest

from rollplex.memory.planner import GIB, PLAN_HEADROOM, Budget, Layout, Workload, plan_memory
from rollplex.memory.shapes import Architecture

# hidden 8, 2 layers, 2 heads of 4 (one kv head), MLP 16, vocabulary 10, untied; vision: one block of
# width 4 (MLP 6), patch rows of 12 values.
TOY = Architecture(8, 2, 2, 1, 4, 16, 10, False, 1, 4, 1, 6, patch_dim=12, merge=2)
# By hand: decoder layer = q 8·8+8 + k 8·4+4 + v 8·4+4 + o 8·8 + MLP 3·8·16 + norms 2·8 = 608;
# language = 2·608 + embed 80 + head 80 + norm 8 = 1384; vision = patches 12·4 = 48 + block (8 + 60 + 20
# + 60 + 28 = 176) + merger (4 + 16·16+16 + 16·8+8 = 412) = 636; total 2020.
PARAMS = 2020
# G=4 groups of N=2, P=10 prompt tokens of which 4 vision (16 patches), R=3, one group per micro-batch.
WORK = Workload(
    groups=4, group_size=2, prompt_tokens=10, vision_tokens=4, response_tokens=3, prefill_fusion=False
)
KIB = 1 / 1024  # chunk_mib of 1 KiB: chunks of 1024 bytes of FP32 masters


def _budget(nbytes: float, **kw) -> Budget:
    """A budget whose usable part (less ``PLAN_HEADROOM``) is ``nbytes``."""
    device = nbytes / GIB / (1 - PLAN_HEADROOM)
    return Budget(
        device_gib=device, host_gib=kw.pop("host", 10**9) / GIB, chunk_mib=KIB, workspace_gib=0, **kw
    )


def _bytes(plan) -> dict[str, dict[str, int]]:
    return {row.name: {w: row.gib[w] * GIB for w in row.gib} for row in plan.rows}


# Hand counts, bytes (model dtype bf16):
HAND = {
    "snapshot": dict.fromkeys(("rollout", "scoring", "backward", "update"), 2 * PARAMS),
    "reference": dict.fromkeys(("rollout", "scoring", "backward", "update"), 2 * PARAMS),
    "master": dict.fromkeys(("rollout", "scoring", "backward", "update"), 4 * PARAMS),
    "adam": dict.fromkeys(("rollout", "scoring", "backward", "update"), 8 * PARAMS),
    "grads": {"backward": 4040, "update": 4040},
    # 2 (K, V) · 2 layers · 1 kv head · 4 · 2 bytes = 32 bytes a token; prompt 4 groups · 10 + own 4·2·3
    "rollout_kv": {"rollout": 32 * (40 + 24)},
    # q/k/v (144) and gate/up (256) copies of 2 layers in bf16, and 8 rows · 10 · 4 bytes · 2
    "decode_graphs": {"rollout": 2 * 800 + 640},
    # per group 32 · 10 KV + 10 · 4 log-probs = 360, actor and reference for 4 groups
    "boundary_kv": {"rollout": 2880, "scoring": 2880, "backward": 1440},
    # per group (10 tokens · 2 layers · 8 + 16 patches · (4 + 12 + 16)) · 2 bytes = 1344
    "prefix_activations": {"rollout": 5376, "scoring": 5376, "backward": 5376},
    "suffix_activations": {"backward": 2 * 6 * 8 * 2},  # 2 layers · 6 tokens (1·2·3) · 8 · 2 bytes
    # without autograd 2·8 + 3·16 = 64 a token, 2·4 + 3·6 = 26 a patch: max(10·64, 16·26)·2 = 1280; scoring
    # 24 rows' tokens · 64 · 2 = 3072; with autograd 4·8 + 4·8 + 4·4 + 4·16 = 144 a token: 10 · 144 · 2
    "layer_working_set": {"rollout": 1280, "scoring": 3072, "backward": 2880},
    "logits": {"scoring": 24 * 10 * 6, "backward": 6 * 10 * 10},  # tokens · vocab · (4 + 2), · (4 + 4 + 2)
    "optimizer_staging": {"update": 128 * 4 + 2 * 1024},  # the MLP weight's FP32 gradient, 2 chunks
}
TOTALS = {"rollout": 46144, "scoring": 45088, "backward": 46848, "update": 38920}
NAIVE = 56168  # each row at its largest: logits 1440 (scoring), the working set 3072 (scoring)


def test_the_toy_architecture_is_counted_by_hand():
    assert TOY.parameters() == PARAMS
    assert TOY.rank_parameters(1).language == 1384 and TOY.vision_parameters() == 636
    rank = TOY.rank_parameters(2)  # layer: qkv 36 + 2·36, o 4·8, gate/up 2·8·8, down 8·8, norms 16 = 348
    assert rank.language == 2 * 348 + 2 * 5 * 8 + 8 and rank.vision == 636


@pytest.mark.parametrize("name", ["qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-32b"])
def test_preset_parameter_counts_are_the_models(name):
    from rollplex.models.presets import meta_model

    assert Architecture.from_preset(name).parameters() == sum(
        p.numel() for p in meta_model(name).parameters()
    )


def test_every_component_and_window_matches_the_hand_count():
    plan = plan_memory(TOY, WORK, _budget(10**9))
    got = _bytes(plan)
    for name, row in got.items():
        expected = HAND.get(name, {})
        assert row == {w: expected.get(w, 0) for w in row}, name
    assert {w: v * GIB for w, v in plan.planned_gib.items()} == TOTALS
    assert plan.naive_gib * GIB == NAIVE
    assert plan.fits and not plan.moves and plan.host_pool_bytes == 0
    assert plan.planned_peak_gib * GIB == TOTALS["backward"]


def test_the_plan_keeps_its_headroom_under_the_budget():
    """A peak at the budget itself does not fit: the plan keeps ``PLAN_HEADROOM`` of it free, so it
    moves state where everything resident would reach the budget exactly."""
    budget = Budget(device_gib=TOTALS["backward"] / GIB, host_gib=10**9 / GIB, chunk_mib=KIB, workspace_gib=0)
    plan = plan_memory(TOY, WORK, budget)
    assert plan.moves and plan.planned_peak_gib <= budget.device_gib * (1 - PLAN_HEADROOM)


def test_everything_resident_when_everything_fits():
    plan = plan_memory(TOY, WORK, _budget(TOTALS["backward"]))
    assert plan.fits and plan.moves == () and plan.optimizer_host_bytes == 0
    assert plan.reference_paging == "resident" and not plan.offload_activations and not plan.offload_grads
    assert all(place in ("device", "-") for row in plan.where().values() for place in row.values())


def test_hidden_moves_come_before_the_optimizer():
    """Just over budget: the reference is paged (the backward window binds), then the prefix's saved
    tensors are offloaded (the rollout window binds); the optimizer state stays."""
    plan = plan_memory(TOY, WORK, _budget(46000))
    assert [m.what for m in plan.moves] == ["reference paging", "prefix activation offload"]
    assert all(m.hidden for m in plan.moves)
    # rollout 46144 - 5376; backward 46848 - 4040 (reference) - 5376 + 2 groups reloaded (2688)
    assert {w: v * GIB for w, v in plan.planned_gib.items()} == {
        "rollout": 40768,
        "scoring": 39712,
        "backward": 40120,
        "update": 34880,
    }
    assert plan.where()["reference"] == {
        "rollout": "device",
        "scoring": "device",
        "backward": "host",
        "update": "host",
    }
    assert plan.where()["prefix_activations"]["rollout"] == "host"
    assert plan.fits and plan.optimizer_host_bytes == 0


def test_the_optimizer_moves_chunk_by_chunk_as_far_as_needed():
    """At 30000 bytes: after the hidden moves the rollout window is 10768 over: 4 chunks of 3 · 1024
    bytes move; the staging ring (3 slots · 3 fields · 1024) then puts the update window 1808 over:
    one more chunk."""
    plan = plan_memory(TOY, WORK, _budget(30000))
    assert [m.what for m in plan.moves] == [
        "reference paging",
        "prefix activation offload",
        "optimizer state to host",
    ]
    assert plan.optimizer_host_bytes == 5 * 3072 and plan.optimizer_host_fraction == 15360 / 24240
    assert plan.moves[-1].traffic_gib * GIB == 2 * 15360 and not plan.moves[-1].hidden
    got = _bytes(plan)
    assert got["master"]["rollout"] == 8080 - 5120 and got["adam"]["update"] == 16160 - 10240
    assert got["optimizer_staging"]["update"] == 2560 + 9 * 1024
    assert {w: v * GIB for w, v in plan.planned_gib.items()} == {
        "rollout": 25408,
        "scoring": 24352,
        "backward": 24760,
        "update": 28736,
    }
    assert plan.fits
    # host pool: 5 chunk views, the reference's 45 tensors, 4 groups' 7 offloaded tensors, each aligned
    assert plan.host_pool_bytes == (15360 + 5 * 512) + (4040 + 45 * 512) + (5376 + 28 * 512)
    assert plan.activation_arena_bytes == 5376 + 28 * 512


def test_nothing_fits_names_the_shortfall_and_the_settings():
    plan = plan_memory(TOY, WORK, _budget(10000))
    assert [m.what for m in plan.moves] == [
        "reference paging",
        "prefix activation offload",
        "optimizer state to host",
        "gradient offload",
    ]
    assert plan.optimizer_host_fraction == 1.0 and plan.offload_grads
    # what is left in the rollout window: snapshot, reference, rollout KV, decode copies, boundary KV,
    # one prefix layer's forward
    assert plan.planned_peak_gib * GIB == 4040 + 4040 + 2048 + 2240 + 2880 + 1280
    assert not plan.fits and plan.shortfall_gib * GIB == 16528 - 10000
    assert plan.advice.startswith(f"needs {6528 / GIB:.1f} GiB more in the rollout window (Phase 1): ")
    for setting in ("memory.device_budget_gib", "rollout.prompts_per_step", "rollout.max_response_tokens"):
        assert setting in plan.advice
    assert "does not fit" in plan.table()


def test_moves_need_room_in_the_host_budget():
    """With 20000 bytes of host room the reference's copy (27080 with its views' alignment) does not
    fit; the activations (19712) do; then there is room for no optimizer chunk."""
    plan = plan_memory(TOY, WORK, _budget(30000, host=20000))
    assert [m.what for m in plan.moves] == ["prefix activation offload"]
    assert not plan.fits and plan.reference_paging == "resident"
    assert plan.host_pool_bytes <= 20000


def test_forced_choices_apply_whatever_the_budget():
    budget = _budget(10**9, optimizer_offload="on", reference_paging="paged", offload_activations="on")
    plan = plan_memory(TOY, WORK, budget)
    assert (
        plan.optimizer_host_fraction == 1.0 and plan.reference_paging == "paged" and plan.offload_activations
    )
    off = _budget(30000, optimizer_offload="off", reference_paging="resident", offload_activations="off")
    plan = plan_memory(TOY, WORK, off)
    assert plan.moves == () and not plan.fits  # gradient offload cannot shrink the backward window
    assert plan.shortfall_gib * GIB == TOTALS["backward"] - 30000


def test_serial_schedule_keeps_prefixes_to_the_backward_window():
    work = dataclasses.replace(WORK, schedule="serial")
    got = _bytes(plan_memory(TOY, work, _budget(10**9)))
    assert got["prefix_activations"] == {"rollout": 0, "scoring": 0, "backward": 1344, "update": 0}
    assert got["boundary_kv"] == {"rollout": 0, "scoring": 1440, "backward": 360, "update": 0}
    assert got["layer_working_set"]["rollout"] == 0
    # all resident: rollout 32320 + 2048 + 2240; scoring + 1440 + 3072 + 1440; backward 32320 + 4040 +
    # 360 + 1344 + 192 + 2880 + 600 = 41736. At 36000: the reference is paged (read in scoring only),
    # then the scoring window is 2272 over: one chunk, whose staging ring puts the update window 5024
    # over: two more. No activation offload: the prefix runs right before its backward.
    plan = plan_memory(TOY, work, _budget(36000))
    assert [m.what for m in plan.moves] == ["reference paging", "optimizer state to host"]
    assert plan.where()["reference"] == {
        "rollout": "host",
        "scoring": "device",
        "backward": "host",
        "update": "host",
    }
    assert plan.optimizer_host_bytes == 3 * 3072
    assert {w: v * GIB for w, v in plan.planned_gib.items()} == {
        "rollout": 36608 - 4040 - 9216,
        "scoring": 38272 - 9216,
        "backward": 41736 - 4040 - 9216,
        "update": 38920 - 4040 - 9216 + 9216,
    }


def test_prefill_fusion_drops_the_rollout_prompt_kv():
    got = _bytes(plan_memory(TOY, dataclasses.replace(WORK, prefill_fusion=True), _budget(10**9)))
    assert got["rollout_kv"]["rollout"] == 32 * 24


def test_parallel_layout_shards_and_shares():
    """dp 2 · tp_train 2 = 4 GPUs, rollout at tp 1 (4 replicas): training ranks hold 2 groups, rollout
    replicas 1, and half the optimizer state of their shard; shared weights are one copy sized for the rollout shard (the whole model), copied ones
    a training shard plus a rollout copy."""
    layout = Layout(dp=2, tp_train=2, tp_rollout=1)
    shared = _bytes(plan_memory(TOY, WORK, _budget(10**9), layout))
    assert shared["snapshot"]["rollout"] == 2 * PARAMS and shared["rollout_weights"]["rollout"] == 0
    assert shared["reference"]["rollout"] == 2 * (784 + 636)
    assert shared["rollout_kv"]["rollout"] == 32 * (10 + 6)
    # 2 groups a rank; per group the KV of one kv head (replicated at tp 2) and 5 vocabulary rows
    assert shared["boundary_kv"]["rollout"] == 2 * 2 * (32 * 10 + 5 * 4)
    # ZeRO-1: each of the 2 data-parallel ranks owns half of its training shard's optimizer state
    assert (
        shared["master"]["update"] == 4 * (784 + 636) // 2
        and shared["adam"]["update"] == 8 * (784 + 636) // 2
    )
    whole = _bytes(plan_memory(TOY, WORK, _budget(10**9), dataclasses.replace(layout, shard_optimizer=False)))
    assert whole["master"]["update"] == 4 * (784 + 636) and whole["adam"]["update"] == 8 * (784 + 636)
    copied = _bytes(plan_memory(TOY, WORK, _budget(10**9), dataclasses.replace(layout, shared_weights=False)))
    assert (
        copied["snapshot"]["rollout"] == 2 * (784 + 636) and copied["rollout_weights"]["update"] == 2 * PARAMS
    )


@pytest.mark.parametrize(
    ("kwargs", "layout", "message"),
    [
        ({"schedule": "fast"}, Layout(), "schedule='fast'"),
        ({"vision_tokens": 11}, Layout(), "vision tokens (11)"),
        ({"groups": 0}, Layout(), "groups must be at least 1"),
        ({}, Layout(tp_train=4), "parallel.tp_train=4 does not split the model's 2 attention heads"),
        ({}, Layout(dp=1, tp_train=2, tp_rollout=4), "parallel.tp_rollout=4"),
    ],
)
def test_unusable_inputs_are_named(kwargs, layout, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_memory(TOY, dataclasses.replace(WORK, **kwargs), _budget(10**9), layout)


def test_budget_choices_are_checked():
    with pytest.raises(ValueError, match="memory.reference_paging='maybe'"):
        plan_memory(TOY, WORK, _budget(10**9, reference_paging="maybe"))


def test_json_and_table():
    plan = plan_memory(TOY, WORK, _budget(30000))
    out = plan.to_json()
    assert {"naive_gib", "planned_peak_gib", "fits", "rows"} <= out.keys()
    assert out["naive_gib"] == NAIVE / GIB and len(out["rows"]) == len(plan.rows)
    assert out["rows"][0]["name"] == "snapshot" and set(out["rows"][0]["gib"]) == {
        "rollout",
        "scoring",
        "backward",
        "update",
    }
    text = plan.table()
    assert text.splitlines()[0].split()[:5] == ["state", "rollout", "(P1)", "scoring", "(P2)"]
    assert any(line.startswith("reference") and " h " in line for line in text.splitlines())
    assert "moves: reference paging" in text


def test_logit_chunk_is_the_forward_passes():
    from rollplex.memory import planner
    from rollplex.models.forward import LOGIT_CHUNK_ELEMENTS

    assert planner.LOGIT_CHUNK_ELEMENTS == LOGIT_CHUNK_ELEMENTS


def test_chunked_optimizer_takes_the_planned_host_chunks():
    """The runtime puts exactly the planned bytes of optimizer state in the host pool."""
    import torch

    from rollplex.memory.chunked_adamw import chunk_layout, host_chunks_for, host_state_bytes

    plan = plan_memory(TOY, WORK, _budget(30000))
    params = [torch.zeros(n, dtype=torch.bfloat16) for n in (1000, 800, 220)]  # 2020 parameters
    layout = chunk_layout(params, 256)  # 1 KiB of FP32 masters a chunk
    chosen = host_chunks_for(layout, plan.optimizer_host_bytes)
    assert sum(layout[i].nbytes for i in chosen) == plan.optimizer_host_bytes
    assert host_state_bytes(layout, chosen) <= plan.host_pool_bytes


@pytest.mark.parametrize(
    ("change", "copies"), [({}, 1600), ({"fused_projections": False}, 0), ({"fused_views": True}, 0)]
)
def test_decode_keeps_weight_copies_only_where_they_are_copies(change, copies):
    got = _bytes(plan_memory(TOY, dataclasses.replace(WORK, **change), _budget(10**9)))
    assert got["decode_graphs"]["rollout"] == copies + 640


def test_an_unbounded_host_budget():
    plan = plan_memory(
        TOY, WORK, Budget(device_gib=30000 / GIB / (1 - PLAN_HEADROOM), chunk_mib=KIB, workspace_gib=0)
    )
    assert plan.fits and plan.optimizer_host_bytes == 5 * 3072


def test_a_plan_short_of_host_memory_says_which_host_budget_makes_it_fit():
    """Device-limited only because the host pool may not take more: the advice names the host budget
    that alone makes it fit (the plan with no host limit's pool), and that budget does make it fit."""
    plan = plan_memory(TOY, WORK, _budget(30000, host=20000))
    unbounded = plan_memory(TOY, WORK, _budget(30000))
    assert not plan.fits and unbounded.fits
    need = math.ceil(unbounded.host_pool_bytes / GIB * 10) / 10
    assert f"memory.host_budget_gib={need:.1f}" in plan.advice
    assert plan_memory(TOY, WORK, _budget(30000, host=need * GIB)).fits
    assert "host_budget" not in plan_memory(TOY, WORK, _budget(10)).advice  # no host budget helps

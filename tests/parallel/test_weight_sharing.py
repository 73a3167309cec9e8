"""One physical actor copy (paper §3.3): the Case 1/2/3 classification (meta device) and, on 4 CPU
processes, training shards that are views into rollout-sized buffers, fused q/k/v and gate/up views
that read the shared bytes, and a refresh after an in-place update."""

from __future__ import annotations

import pytest
import torch

from rollplex.models.presets import meta_model
from rollplex.parallel.layout import shard_index, shard_shape
from rollplex.parallel.tensor_parallel import shard_model
from rollplex.parallel.weight_sharing import (
    SharedWeights,
    Unit,
    case_rows,
    classify,
    classify_unit,
    format_case_rows,
    megatron_shards,
    model_heads,
    rollplex_shards,
)
from tests.parallel.common import batch, build_model, context, reference_copy, score


def _rows(preset: str, tp_train: int, tp_rollout: int, **kw):
    model = meta_model(preset)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return case_rows(classify(shapes, tp_train, tp_rollout, heads=model_heads(model), **kw), tp_rollout)


def test_paper_pair_reproduces_60_0_32_8_7_2_for_32b():
    """Megatron-Core training (fused QKV interleaved per key/value group) against a vLLM-style rollout,
    TP 8 -> 4: the paper's 19.7 / 10.7 / 2.4 B parameters and its 1.1 GiB Case-3 buffer per GPU."""
    one, two, three = _rows("qwen2.5-vl-32b", 8, 4, training=megatron_shards)
    assert (one.lm_params, two.lm_params, three.lm_params) == (19_677_189_120, 10_737_418_240, 2_349_268_992)
    assert [round(r.lm_percent, 2) for r in (one, two, three)] == [60.06, 32.77, 7.17]
    assert three.rollout_bytes == 2_349_268_992 // 4 * 2  # BF16, rollout TP 4: 1.09 GiB
    assert three.tensors == 64 * 6  # q/k/v weights and biases of every layer
    lines = format_case_rows([one, two, three])
    assert (
        len(lines) == 4 and lines[3].startswith("Case 3") and "7.17 %" in lines[3] and "1.17 GB" in lines[3]
    )


@pytest.mark.parametrize(
    ("preset", "tp_train", "tp_rollout", "case1", "case2"),
    [
        ("qwen2.5-vl-32b", 8, 4, 22_026_458_112, 10_737_418_240),  # 67.23 % / 32.77 %
        ("qwen2.5-vl-7b", 4, 2, 5_354_886_656, 2_260_729_856),  # 70.31 % / 29.69 %
    ],
)
def test_rollplex_layout_leaves_case_3_empty(preset, tp_train, tp_rollout, case1, case2):
    one, two, three = _rows(preset, tp_train, tp_rollout)
    assert (one.lm_params, two.lm_params) == (case1, case2)
    assert three.params == three.tensors == three.rollout_bytes == 0
    assert round(one.lm_percent + two.lm_percent, 9) == 100.0


def test_interleaved_qkv_lines_up_only_with_one_group_per_rank():
    """At equal TP the two QKV orders coincide only when a rank holds exactly one key/value
    group (32B at TP 8); two groups per rank (TP 4) interleave differently."""
    q_rows, kv_rows = 40 * 128, 8 * 128
    unit = Unit("layers.0.qkv", ("q", "k", "v"), "qkv", (q_rows, kv_rows, kv_rows), 0, (40, 8))
    assert classify_unit(unit, 8, 8, megatron_shards, rollplex_shards) == 1
    assert classify_unit(unit, 4, 4, megatron_shards, rollplex_shards) == 3
    assert classify_unit(unit, 8, 4, rollplex_shards, rollplex_shards) == 1
    row = Unit("layers.0.self_attn.o_proj.weight", ("o",), "row", (q_rows,), 0)
    assert classify_unit(row, 8, 2) == 2
    with pytest.raises(ValueError, match="TP_rollout 3 does not divide TP_train 8"):
        classify_unit(row, 8, 3)


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


def _inside(param: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Same storage, and the parameter's bytes lie in the buffer's range."""
    size = param.element_size()
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * size
    last = param.data_ptr() + (param.numel() - 1) * size  # a contiguous slab (or its transpose)
    same = param.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    return same and start <= param.data_ptr() and last < end


def _rollout_layer(full: dict, i: int, tr: int, r: int) -> dict[str, torch.Tensor]:
    """What rollout rank r of TP tr must read of layer i, from the full weights."""
    pre = f"model.language_model.layers.{i}."

    def rows(name):
        return full[pre + name][shard_index(pre + name, tuple(full[pre + name].shape), tr, r)]

    return {
        "qkv": torch.cat([rows(f"self_attn.{x}_proj.weight") for x in "qkv"]),
        "qkv_bias": torch.cat([rows(f"self_attn.{x}_proj.bias") for x in "qkv"]),
        "gate_up": torch.cat([rows("mlp.gate_proj.weight"), rows("mlp.up_proj.weight")]),
        "o": rows("self_attn.o_proj.weight"),
        "down": rows("mlp.down_proj.weight"),
    }


def _rollout_errors(shared: SharedWeights, full: dict, tr: int, r: int) -> float:
    worst = 0.0
    for i in range(len(shared.model.model.language_model.layers)):
        want, views, tensors = _rollout_layer(full, i, tr, r), shared.fused_views(i), shared.decode_tensors(i)
        got = {"qkv": views.qkv, "qkv_bias": views.qkv_bias, "gate_up": views.gate_up}
        got.update(o=tensors[3], down=tensors[6])
        worst = max(worst, *(float((got[k] - want[k]).abs().max()) for k in want))
    for name, tensor in (
        ("model.language_model.embed_tokens.weight", shared.embedding()),
        ("lm_head.weight", shared.lm_head()),
    ):
        worst = max(
            worst, float((tensor - full[name][shard_index(name, tuple(full[name].shape), tr, r)]).abs().max())
        )
    return worst


def _pointer_checks(model, shared: SharedWeights) -> list[str]:
    """Names of the training parameters that are NOT views into their rollout buffer (expected: none),
    and fused views that are not the buffers of their layer's q/k/v and gate/up parameters."""
    bad = []
    lm = model.model.language_model
    for i, layer in enumerate(lm.layers):
        views, tensors = shared.fused_views(i), shared.decode_tensors(i)
        buffers = {"self_attn.o_proj": tensors[3].t(), "mlp.down_proj": tensors[6].t()}
        for name in LINEARS:
            buffers[name] = views.gate_up if name.startswith("mlp") else views.qkv
        for name, buffer in buffers.items():
            if not _inside(layer.get_submodule(name).weight, buffer):
                bad.append(f"layers.{i}.{name}.weight")
        for x in "qkv":
            if not _inside(layer.get_submodule(f"self_attn.{x}_proj").bias, views.qkv_bias):
                bad.append(f"layers.{i}.{x}_proj.bias")
        if not (tensors[3].is_contiguous() is False and tensors[3].t().is_contiguous()):
            bad.append(f"layers.{i}: o_proj rollout view is not a transposed slab")
    if not _inside(lm.embed_tokens.weight, shared.embedding()) or not _inside(
        model.lm_head.weight, shared.lm_head()
    ):
        bad.append("embedding / lm_head")
    return bad


def _delta(name: str, full_shape: tuple, tp: int, t: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * index + t)
    return torch.randn(shard_shape(name, full_shape, tp, t), generator=g)


def sharing_on_ranks(tp: int, tr: int, dp: int) -> dict:
    ctx = context(tp, tr, dp)
    model = build_model()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    shapes = shard_model(model, ctx.train_tp)
    prompts, responses = batch()
    before = score(model, prompts, responses[:, :2], comm=ctx.train_tp, attached=False)[1]
    shared = SharedWeights(model, ctx.train_tp, ctx.share, ctx.rollout_tp)
    after = score(model, prompts, responses[:, :2], comm=ctx.train_tp, attached=False)[1]
    r = ctx.rollout_tp.rank
    out = {"bad": _pointer_checks(model, shared), "initial": _rollout_errors(shared, full, tr, r)}
    out["forward"] = float((after - before).abs().max())
    # an optimizer step writes each training shard in place; refresh completes the rollout shards
    updated = {}
    with torch.no_grad():
        for index, (name, p) in enumerate(model.named_parameters()):
            if name in shapes and p.shape != torch.Size(shapes[name]):
                p.add_(_delta(name, shapes[name], tp, ctx.train_tp.rank, index))
                total = full[name].clone()
                for t in range(tp):
                    total[shard_index(name, shapes[name], tp, t)] += _delta(name, shapes[name], tp, t, index)
                updated[name] = total
            else:
                updated[name] = full[name]
    stale = _rollout_errors(shared, updated, tr, r)
    shared.refresh()
    out.update(stale=stale, refreshed=_rollout_errors(shared, updated, tr, r), q=shared.q)
    out["buffers"] = len(shared.buffers())
    return out


@pytest.mark.parametrize(("tp", "tr", "dp"), [(4, 2, 1), (2, 1, 2), (4, 1, 1), (2, 2, 2)])
def test_training_shards_are_views_and_refresh_completes_rollout_shards(ranks, tp, tr, dp):
    for rank, out in enumerate(ranks(4, sharing_on_ranks, tp, tr, dp)):
        assert out["bad"] == [], (rank, out["bad"])
        assert out["initial"] == 0.0, rank  # bytes copied, not computed
        assert out["forward"] <= 1e-6, rank  # transposed views: same products up to the GEMM's rounding
        assert out["refreshed"] <= 1e-6, rank  # the update's sums in float32
        assert out["q"] == tp // tr
        if tp // tr > 1:
            assert out["stale"] > 0.1, rank  # before refresh, the other pieces were the old weights
        assert out["buffers"] == 2 * 5 + 2  # 2 layers × (qkv, qkv_bias, gate_up, o, down) + embed + head


def decode_layer_on_shared_views(tp: int, tr: int, dp: int) -> dict:
    """rollout.decode's layer functions on this rank's shared rollout tensors (decode_tensors, per-rank
    heads, the rollout head's all-reduce after o_proj and down_proj, as the integration will wire
    layer_post) == the single-process decode layer on the full weights."""
    from rollplex.rollout.decode import (
        DecodeShape,
        _layer_tensors,
        decode_attention,
        layer_post,
        layer_qkv,
        rms_norm,
    )

    ctx = context(tp, tr, dp)
    model = build_model()
    layer = reference_copy(model).model.language_model.layers[0]
    shard_model(model, ctx.train_tp)
    shared = SharedWeights(model, ctx.train_tp, ctx.share, ctx.rollout_tp)
    head = shared.rollout_head()
    g = torch.Generator().manual_seed(9)
    rows, d, p = 3, 8, 5
    hidden = torch.randn(rows, 64, generator=g)
    angles = torch.randn(rows, d, generator=g)
    cos, sin = angles.cos(), angles.sin()
    prefix_k, prefix_v = torch.randn(2, 1, 4, p, d, generator=g).unbind(0)
    own_k, own_v = torch.randn(2, rows, 4, 2, d, generator=g).unbind(0)
    bias = torch.zeros(rows, 1, 1, p + 2)
    eps, scaling = layer.input_layernorm.variance_epsilon, layer.self_attn.scaling
    full = DecodeShape(1, rows, 8, 4, d, 2, scaling, eps)
    q, _, _ = layer_qkv(hidden, cos, sin, _layer_tensors(layer, fused=True), full)
    attention = decode_attention(q, prefix_k, prefix_v, own_k, own_v, bias, full)
    want = layer_post(hidden, attention, _layer_tensors(layer, fused=True), full)

    mine = DecodeShape(1, rows, head.heads, head.kv_heads, d, 2, scaling, eps)
    weights = shared.decode_tensors(0)
    kv = slice(head.comm.rank * head.kv_heads, (head.comm.rank + 1) * head.kv_heads)
    q_r, _, _ = layer_qkv(hidden, cos, sin, weights, mine)
    att_r = decode_attention(q_r, prefix_k[:, kv], prefix_v[:, kv], own_k[:, kv], own_v[:, kv], bias, mine)
    hidden2 = hidden + head.all_reduce(torch.nn.functional.linear(att_r, weights[3]))
    gate, up = torch.nn.functional.linear(rms_norm(hidden2, weights[4], eps), weights[5][0]).chunk(2, dim=-1)
    got = hidden2 + head.all_reduce(
        torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, weights[6])
    )
    cols = slice(head.comm.rank * head.heads * d, (head.comm.rank + 1) * head.heads * d)
    return {
        "q": float((q_r - q[:, head.comm.rank * head.heads : (head.comm.rank + 1) * head.heads]).abs().max()),
        "attention": float((att_r - attention[:, cols]).abs().max()),
        "out": float((got - want).abs().max()),
        "heads": (head.heads, head.kv_heads),
    }


@pytest.mark.parametrize(("tp", "tr", "dp"), [(4, 2, 1), (4, 4, 1), (2, 1, 2)])
def test_decode_layer_reads_the_shared_rollout_shards(ranks, tp, tr, dp):
    for rank, out in enumerate(ranks(4, decode_layer_on_shared_views, tp, tr, dp)):
        assert out["heads"] == (8 // tr, 4 // tr)
        assert out["q"] == 0.0 and out["attention"] <= 1e-6, (rank, out)
        assert out["out"] <= 1e-5, (rank, out)  # row-parallel partial sums added in another order

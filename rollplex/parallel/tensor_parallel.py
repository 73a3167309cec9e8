"""Tensor parallelism of a transformers Qwen2.5-VL model, Megatron style: local shards, explicit collectives.

Method: Megatron-LM (Shoeybi et al., arXiv:1909.08053 §3, its operators f and g). In each decoder
layer the replicated hidden state enters the column-parallel q/k/v (and gate/up) through ``f``
(identity forward, all-reduce of the gradient in backward), each rank computes its own heads (MLP
rows), and the row-parallel o_proj (down_proj) returns partial sums that ``g`` all-reduces (forward
all-reduce, identity backward). Two all-reduces per layer forward, two in backward. The token
embedding is split over vocabulary rows (masked lookup, then ``g``); the LM head is column-parallel
over the vocabulary after ``f`` and returns this rank's logit columns, which
``parallel.vocab_parallel`` turns into log-probs without gathering them.

Because every activation between blocks is replicated and every gradient that reaches a replicated
parameter has passed an ``f``, the gradients of replicated parameters (norms, vision tower, merger)
come out complete and equal on every TP rank: no extra all-reduce over the TP group.

``shard_model`` changes the model in place: parameters become their shard (``parallel.layout``),
o_proj/down_proj/embed_tokens/lm_head change class to the parallel modules below (same parameter
names, so state-dict keys and ``named_parameters`` keep theirs), each attention module's and MLP's
input passes ``f`` (a forward pre-hook), and each attention module's head counts become per-rank. The
attention functions of models.attention take head counts from tensor shapes, so the prefix and
suffix passes of models.forward run unchanged on the local heads; boundary KV is per rank
[G, Hkv/tp, P, D].

Hooks for the layers below (they must not import this package): ``model.rollplex_tp`` is a
``parallel.vocab_parallel.TensorParallelHead``; see its docstring for how models.forward and the
decode step use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollplex.parallel.dist import Comm
from rollplex.parallel.layout import Placement, entry, shard_index, undivided_size


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce (sum) of the gradient over the TP group in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_reduce(grad.contiguous().clone()), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return comm.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension (shards in rank order) forward; this rank's slice of the
    gradient backward (the gathered tensor is used identically on every rank, so each rank's gradient
    of it is already complete)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm, ctx.width = comm, x.shape[-1]
        pieces = torch.empty((comm.size, *x.shape), dtype=x.dtype, device=x.device)
        comm.all_gather_into(pieces, x.contiguous())
        return torch.cat(pieces.unbind(0), dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.comm.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``x`` unchanged; its gradient all-reduced over ``comm`` in backward (Megatron's f)."""
    return x if comm.size == 1 else _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum of ``x`` over ``comm`` (a new tensor); gradient passed through unchanged (Megatron's g)."""
    return x if comm.size == 1 else _ReduceFromTP.apply(x, comm)


def gather_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[..., n] shards of every rank concatenated along the last dimension: [..., size·n]; gradient:
    this rank's slice."""
    return x if comm.size == 1 else _GatherFromTP.apply(x, comm)


class RowParallelLinear(nn.Linear):
    """nn.Linear whose weight holds input columns [in/tp] of the logical [out, in] weight (it may be a
    transposed view, ``storage: transposed``: F.linear then uses the GEMM's transpose mode): the
    product is this rank's partial sum, all-reduced (``reduce_from_tp``); a bias is added after the
    sum. Attribute ``tp_comm``."""

    tp_comm: Comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tp(F.linear(x, self.weight), self.tp_comm)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding holding vocabulary rows [vocab_start, vocab_start + rows): ids outside look up
    zeros, and the sum over the TP group (``reduce_from_tp``) gives every rank the full embedding.
    Attributes ``tp_comm``, ``vocab_start``, ``full_vocab``."""

    tp_comm: Comm
    vocab_start: int
    full_vocab: int

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= rows)
        pad = self.padding_idx if self.padding_idx is not None and 0 <= self.padding_idx < rows else None
        out = F.embedding(local.masked_fill(outside, 0), self.weight, pad)
        return reduce_from_tp(out.masked_fill(outside[..., None], 0.0), self.tp_comm)


class ParallelLMHead(nn.Linear):
    """LM head holding vocabulary rows [vocab_start, vocab_start + out_features): returns this rank's
    logit columns [..., V/tp] of the replicated hidden state, which enters through ``copy_to_tp``.
    Attributes ``tp_comm``, ``vocab_start``, ``full_vocab``."""

    tp_comm: Comm
    vocab_start: int
    full_vocab: int

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(hidden, self.tp_comm), self.weight, self.bias)


def _copy_input_hook(comm: Comm):
    """A forward pre-hook (with kwargs) passing a module's hidden-state input through ``copy_to_tp``:
    positional (the MLP's ``x``) or the keyword ``hidden_states`` (the attention module's)."""

    def hook(module, args, kwargs):
        if args:
            return (copy_to_tp(args[0], comm), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_to_tp(kwargs["hidden_states"], comm)}

    return hook


def _set_shard(model: nn.Module, name: str, full: torch.Tensor, comm: Comm) -> nn.Parameter:
    """Replace parameter ``name`` of ``model`` by ``comm.rank``'s shard of it (a fresh contiguous
    Parameter with the same requires_grad)."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    shard = full[shard_index(name, tuple(full.shape), comm.size, comm.rank)]
    param = nn.Parameter(shard.detach().clone().contiguous(), requires_grad=full.requires_grad)
    setattr(module, attr, param)
    return param


def _swap(module: nn.Module, cls: type, comm: Comm, **attrs) -> None:
    module.__class__ = cls
    module.tp_comm = comm
    for key, value in attrs.items():
        setattr(module, key, value)


def shard_model(model: nn.Module, comm: Comm) -> dict[str, tuple[int, ...]]:
    """Shard a full Qwen2.5-VL model in place for the TP group ``comm`` (module docstring); returns the
    full (logical) shape of every parameter, by name, for the planner and weight sharing.

    Every rank must hold the same full weights before the call (loaded from one checkpoint, or
    initialised from one seed). A tied LM head (3B) stays tied: lm_head.weight is the embedding shard.
    After the call ``model.rollplex_tp`` is the model's ``TensorParallelHead``. With ``comm.size`` 1
    nothing changes but the hook.

    Raises:
        ValueError: a parameter with no layout entry, or a split dimension (heads, MLP width,
            vocabulary) not divisible by ``comm.size``.
    """
    from rollplex.parallel.vocab_parallel import TensorParallelHead

    lm = model.model.language_model
    config = lm.config
    tp = comm.size
    _check_divisible(config, tp)
    full = {name: tuple(p.shape) for name, p in model.named_parameters()}
    tied = model.lm_head.weight is lm.embed_tokens.weight
    vocab = config.vocab_size
    start, n = comm.rank * (vocab // tp), vocab // tp
    if tp > 1:
        for name in list(full):
            if entry(name).train is not Placement.REPLICATED:
                _set_shard(model, name, model.get_parameter(name), comm)
        if tied:
            model.lm_head.weight = lm.embed_tokens.weight
        _swap(lm.embed_tokens, VocabParallelEmbedding, comm, vocab_start=start, full_vocab=vocab)
        _swap(model.lm_head, ParallelLMHead, comm, vocab_start=start, full_vocab=vocab, out_features=n)
        for layer in lm.layers:
            _shard_layer(layer, comm)
    model.rollplex_tp = TensorParallelHead(
        comm,
        vocab_start=start,
        full_vocab=vocab,
        heads=config.num_attention_heads // tp,
        kv_heads=config.num_key_value_heads // tp,
        lm_head=model.lm_head,
    )
    return full


def _check_divisible(config, tp: int) -> None:
    """Raises ValueError naming the first size ``tp`` does not divide (``layout.undivided_size``)."""
    undivided = undivided_size(config, tp)
    if undivided is not None:
        raise ValueError(
            f"the model's {undivided[0]}, {undivided[1]}, is not divisible by the TP degree {tp}"
        )


def _shard_layer(layer: nn.Module, comm: Comm) -> None:
    """Per-layer part of ``shard_model`` (parameters already sharded): row-parallel classes, the f
    hooks, per-rank head counts."""
    attn, mlp, tp = layer.self_attn, layer.mlp, comm.size
    for linear in (attn.o_proj, mlp.down_proj):
        _swap(linear, RowParallelLinear, comm, in_features=linear.weight.shape[1])
    for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        linear.out_features = linear.weight.shape[0]
    attn.register_forward_pre_hook(_copy_input_hook(comm), with_kwargs=True)
    mlp.register_forward_pre_hook(_copy_input_hook(comm), with_kwargs=True)
    attn.num_heads //= tp
    attn.num_key_value_heads //= tp


def grad_norm(named_parameters, comm: Comm) -> torch.Tensor:
    """L2 norm of the whole model's gradient under tensor parallelism, equal on every rank of ``comm``
    (what clipping needs): the squared norms of this rank's shards summed over the group, the
    replicated parameters' (equal on every rank) counted once. float32 scalar (float64 for float64
    gradients); parameters without a gradient count 0.

    Raises:
        ValueError: a parameter with no layout entry.
    """
    sharded, replicated = [], []
    for name, p in named_parameters:
        if p.grad is not None:
            wide = p.grad.to(torch.promote_types(p.grad.dtype, torch.float32))
            side = replicated if entry(name).train is Placement.REPLICATED else sharded
            side.append(wide.pow(2).sum())
    ref = (sharded or replicated)[0]
    total = comm.all_reduce(torch.stack(sharded).sum() if sharded else torch.zeros_like(ref))
    return (total + (torch.stack(replicated).sum() if replicated else 0.0)).sqrt()

"""The decode step: one new token per row against the shared boundary KV, with static shapes.

Legend: G groups, N group size, B = G·N rows, H query heads, Hkv key/value heads, D head dim,
Hd hidden size, V vocabulary, P padded prompt length, R response budget, L own-key window.

Every buffer the step reads or writes is allocated once per rollout (the boundary KV of the rollout
prefix, a [B, Hkv, R, D] cache of generated keys/values per layer, the token and step index, the
recorded responses and log-probs), so the step has the same shapes and addresses at every token. On
CUDA a whole step — forward, sampling, recording — is therefore captured as one CUDA graph per own-key
window L (the multiples of ``resolve_graph_window``'s window) and replayed ``eos_check_every`` times per
round of the decode loop with no host work in between; the layer functions can also be compiled
(torch.compile) first.

The arithmetic is the Qwen2.5-VL decoder layer of transformers (RMSNorm, q/k/v with bias, rotary
embedding, o_proj, SiLU-gated MLP), written here as one pure function of the layer's tensors so that it
can be compiled and captured; for response tokens all three M-RoPE rows carry the same position, where
M-RoPE equals plain RoPE. tests/numerics checks it against the model's own full-sequence forward in
float64. Attention is exact: one softmax over [group's boundary KV ; the row's own keys], the boundary
KV read once per group (the N rows' queries are stacked against it), never copied N times.
"""

from __future__ import annotations

import logging
import os
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rollplex.config import COMPILE_MODES, DECODE_ATTENTION
from rollplex.rollout import sample_kernel
from rollplex.rollout.decode_kernel import OWN_CHUNK, fused_decode_attention, supports, triton
from rollplex.rollout.linear_kernel import MAX_ROWS as GATE_MAX_ROWS
from rollplex.rollout.linear_kernel import gated_up_product
from rollplex.rollout.sampler import race_tokens, sample_rows, sample_tokens
from rollplex.types import PrefixState

log = logging.getLogger(__name__)

NEG_INF = float("-inf")
DENSE_WINDOW = 128  # own-key window of the dense attention's graphs by default (``resolve_graph_window``)


def resolve_graph_window(setting: int, attention: str) -> int:
    """Own-key window granularity of the captured decode steps, in tokens: ``setting`` when positive;
    for 0 (``rollout.graph_window``'s default), one own-key chunk of the fused attention
    (``decode_kernel.OWN_CHUNK``, 512 keys) with ``attention`` "triton", ``DENSE_WINDOW`` (128) with
    "dense".

    Why: the fused kernel's launch depends on the window only through its number of own-key chunks,
    and reads no key past the step, so any window inside one chunk launches the same programs and
    gives the same bits; a finer window only adds captures (and their setup time: benchmarks/README.md).
    A window that is not a divisor of the chunk (say 300) cuts windows across
    chunk boundaries, where a step's launch gets one more own-key chunk: exact, but not bitwise the
    default's. The dense attention's score tensors span the whole window, so a finer window saves it
    masked work, and a step reads at most ``window - 1`` masked cache slots.

    Raises:
        ValueError: a negative ``setting``, or ``attention`` other than "triton" and "dense" (resolve
            "auto" first: ``_check_attention``).
    """
    if setting < 0 or attention not in ("triton", "dense"):
        raise ValueError(
            f"graph window {setting!r} for attention {attention!r}: expected a window >= 0 and a resolved "
            "attention, triton or dense"
        )
    if setting > 0:
        return setting
    return OWN_CHUNK if attention == "triton" else DENSE_WINDOW


class BackendUnavailable(ValueError):
    """A decode backend that was asked for cannot run on this device (e.g. Triton attention on a CPU
    without Triton's interpreter)."""


@dataclass(frozen=True)
class DecodeShape:
    """Sizes of one rollout's decode step (plain ints, so compiled code specialises on them)."""

    groups: int
    group_size: int
    heads: int
    kv_heads: int
    head_dim: int
    budget: int
    scaling: float
    eps: float
    gated_kernel: bool = False  # the MLP's gate/up product and SiLU gate as one Triton kernel

    @property
    def rows(self) -> int:
        return self.groups * self.group_size


LayerTensors = tuple  # (ln1, qkv weights, qkv biases, o_proj, ln2, gate/up weights, down_proj); see below


@dataclass(frozen=True, eq=False)
class EngineShard:
    """This process's part of a rollout that several processes decode (built by rollplex.parallel; a
    one-process rollout has none and runs as it always has).

    Fields:
        weights: what the rollout reads, at TP_rollout, without a copy: ``decode_tensors(i)`` (layer
            i's tensors in ``_layer_tensors``' fused order, views of the actor's bytes),
            ``embedding()`` and ``lm_head()`` ([V/tp, Hd] rows of this rank)
            (parallel.weight_sharing.SharedWeights).
        head: the rollout TP group's hook (parallel.vocab_parallel.TensorParallelHead: per-rank
            ``heads`` and ``kv_heads``, ``embed``, ``all_reduce``, the vocabulary-parallel ``race``,
            ``full_vocab``), or None when TP_rollout is 1 (full-vocabulary products and race).
        first_row, total_rows: this engine decodes rows [first_row, first_row + B) of a rollout of
            ``total_rows`` rows over every engine: it draws every row's sampling noise and races on its
            own (rollout.sampler.sample_rows), so its tokens are those one process would sample.
        all_finished: bool [] (this engine's rows have all ended) → bool [] (every engine's have):
            a collective over the decoding processes, so every engine stops at the same round and their
            generators stay in step.
        vocab: V, the vocabulary size (the noise's width).
    """

    weights: object
    head: object | None
    first_row: int
    total_rows: int
    all_finished: Callable[[torch.Tensor], torch.Tensor]
    vocab: int


def _layer_tensors(layer, fused: bool = False) -> LayerTensors:
    """One Qwen2.5-VL decoder layer's tensors in the order ``layer_qkv`` and ``layer_post`` take them:
    (input norm, (W_q, W_k, W_v), (b_q, b_k, b_v), W_o, post norm, (W_gate, W_up), W_down) — or, with
    ``fused``, ((W_q; W_k; W_v),), ((b_q; b_k; b_v),) and ((W_gate; W_up),): copies of the current
    weights concatenated along the output dimension, so each group is one matrix product (they take the
    memory of those weights again for as long as the decoder lives)."""
    a, m = layer.self_attn, layer.mlp
    qkv = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
    bias = (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
    gate_up = (m.gate_proj.weight, m.up_proj.weight)
    if fused:
        qkv, bias, gate_up = (torch.cat(qkv),), (torch.cat(bias),), (torch.cat(gate_up),)
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return norms[0], qkv, bias, a.o_proj.weight, norms[1], gate_up, m.down_proj.weight


def _project(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple | None, sizes: list[int]
) -> tuple[torch.Tensor, ...]:
    """The products x·W_iᵀ (+ b_i) of output widths ``sizes``: one product split by columns when the
    weights come concatenated (a 1-tuple), else one product per weight."""
    biases = biases if biases is not None else (None,) * len(weights)
    if len(weights) == 1:
        return F.linear(x, weights[0], biases[0]).split(sizes, dim=-1)
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen2.5-VL RMSNorm, operation for operation: normalised in float32 (in float64 for a
    float64 model, where transformers would round through float32), then cast back."""
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def residual_add(hidden: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """hidden + update in hidden's dtype, bitwise. Under torch.compile the sum is formed in float32
    (float64 for a float64 model) and rounded once, which is what an add in bf16 does: written as a
    plain add, inductor would fold ``hidden + x·Wᵀ`` into an addmm, whose cuBLAS call first copies the
    residual into its output (one more kernel per product); written this way, the add joins the norm
    kernel after it. Eager, the plain add (one kernel instead of four)."""
    if not torch.compiler.is_compiling():
        return hidden + update
    wide = torch.promote_types(hidden.dtype, torch.float32)
    return (hidden.to(wide) + update.to(wide)).to(hidden.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, heads, D] with cos/sin [B, D]: x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype
) -> tuple[torch.Tensor, ...]:
    """cos, sin [B, D] of positions int64 [B], computed as transformers does (float32, then ``dtype``)."""
    freqs = positions[:, None].float() * inv_freq.to(torch.float)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def decode_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    bias: torch.Tensor,
    shape: DecodeShape,
) -> torch.Tensor:
    """Exact attention of one query per row over [its group's boundary KV ; its own keys].

    Args:
        q: [B, H, D] after RoPE. prefix_k/prefix_v: [G, Hkv, P, D]. own_k/own_v: [B, Hkv, L, D].
        bias: float32 [B, 1, 1, P + L], 0 where a key is visible, -inf at prompt padding and at own
            slots after the current token.

    Returns:
        [B, H·D] in the dtype of ``q``. Scores are scaled and normalised in float32 (float64 for a
        float64 model), one softmax over both parts, as a full-sequence forward does.
    """
    g, n, hkv, d = shape.groups, shape.group_size, shape.kv_heads, shape.head_dim
    b, rep, p = shape.rows, shape.heads // hkv, prefix_k.shape[2]
    stacked = q.view(g, n, hkv, rep, d).transpose(1, 2).reshape(g, hkv, n * rep, d)
    s_prefix = torch.matmul(stacked, prefix_k.transpose(-1, -2))  # [G, Hkv, N·rep, P]
    s_prefix = s_prefix.view(g, hkv, n, rep, p).transpose(1, 2).reshape(b, hkv, rep, p)
    s_own = torch.matmul(q.view(b, hkv, rep, d), own_k.transpose(-1, -2))  # [B, Hkv, rep, L]
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.cat([s_prefix, s_own], dim=-1).to(dtype) * shape.scaling + bias
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    p_prefix, p_own = probs.split([p, own_k.shape[2]], dim=-1)
    p_prefix = p_prefix.reshape(g, n, hkv, rep, p).transpose(1, 2).reshape(g, hkv, n * rep, p)
    out = torch.matmul(p_prefix, prefix_v).view(g, hkv, n, rep, d).transpose(1, 2).reshape(b, hkv, rep, d)
    out = out + torch.matmul(p_own, own_v)
    return out.reshape(b, shape.heads * d)


def layer_qkv(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: LayerTensors,
    shape: DecodeShape,
    rope: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First half of a decoder layer: input norm, q/k/v projections, RoPE (unless ``rope`` is False:
    the fused attention rotates q and k itself).

    Args:
        hidden: [B, Hd]. cos/sin: [B, D]. weights: ``_layer_tensors`` of the layer (either layout).

    Returns:
        q [B, H, D], k [B, Hkv, D], v [B, Hkv, D] (without ``rope``, views of the product's output).
    """
    ln1, qkv, bias = weights[:3]
    b, d, h, hkv = shape.rows, shape.head_dim, shape.heads, shape.kv_heads
    x = rms_norm(hidden, ln1, shape.eps)
    q, k, v = _project(x, qkv, bias, [h * d, hkv * d, hkv * d])
    q, k = q.reshape(b, h, d), k.reshape(b, hkv, d)
    if rope:
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    return q, k, v.reshape(b, hkv, d)


def layer_post(
    hidden: torch.Tensor,
    attention: torch.Tensor,
    weights: LayerTensors,
    shape: DecodeShape,
    reduce: Callable | None = None,
) -> torch.Tensor:
    """After attention [B, H·D]: o_proj, residual, post norm, SiLU-gated MLP, residual → hidden [B, Hd].
    With ``shape.gated_kernel`` (concatenated gate/up weights only), the gate/up product and its SiLU
    gate are one Triton kernel (rollout.linear_kernel). Under tensor parallelism (``reduce``: the sum
    over the rollout TP group, ``EngineShard.head.all_reduce``) ``attention`` holds this rank's heads,
    W_o and W_down this rank's input columns, and the two row-parallel products are partial sums that
    ``reduce`` adds up before each residual (Megatron-LM's g)."""
    wo, ln2, gate_up, down = weights[3:]
    hidden = residual_add(hidden, _summed(F.linear(attention, wo), reduce))
    x = rms_norm(hidden, ln2, shape.eps)
    if shape.gated_kernel:
        return residual_add(hidden, _summed(F.linear(gated_up_product(x, gate_up[0]), down), reduce))
    gate, up = _project(x, gate_up, None, [down.shape[1]] * 2)
    return residual_add(hidden, _summed(F.linear(F.silu(gate) * up, down), reduce))


def _summed(partial: torch.Tensor, reduce: Callable | None) -> torch.Tensor:
    """A row-parallel product's partial sums added over the TP group (``reduce``), or the product."""
    return partial if reduce is None else reduce(partial)


def layer_out(
    hidden: torch.Tensor,
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    bias: torch.Tensor,
    weights: LayerTensors,
    shape: DecodeShape,
    reduce: Callable | None = None,
) -> torch.Tensor:
    """Second half of a decoder layer with the dense attention: ``decode_attention`` then
    ``layer_post`` (``reduce`` as there). Shapes as in ``decode_attention``; returns hidden [B, Hd]."""
    attention = decode_attention(q, prefix_k, prefix_v, own_k, own_v, bias, shape)
    return layer_post(hidden, attention, weights, shape, reduce)


def layer_post_qkv(
    hidden: torch.Tensor,
    attention: torch.Tensor,
    weights: LayerTensors,
    next_weights: LayerTensors,
    cos: torch.Tensor,
    sin: torch.Tensor,
    shape: DecodeShape,
    rope: bool = True,
    reduce: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer_post`` of one layer, then ``layer_qkv`` of the next, as one function: compiled, the
    residual add ending the layer and the next layer's input norm become one kernel.

    Args:
        hidden: [B, Hd]. attention: [B, H·D]. weights / next_weights: ``_layer_tensors`` of this layer
            and the next. cos/sin: [B, D]. rope: as in ``layer_qkv`` (False for the fused attention,
            which rotates q and k itself). reduce: as in ``layer_post``.

    Returns:
        hidden [B, Hd] after this layer, and the next layer's q, k, v (shapes as in ``layer_qkv``).
    """
    hidden = layer_post(hidden, attention, weights, shape, reduce)
    return (hidden, *layer_qkv(hidden, cos, sin, next_weights, shape, rope))


def layer_out_qkv(
    hidden: torch.Tensor,
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    own_k: torch.Tensor,
    own_v: torch.Tensor,
    bias: torch.Tensor,
    weights: LayerTensors,
    next_weights: LayerTensors,
    cos: torch.Tensor,
    sin: torch.Tensor,
    shape: DecodeShape,
    reduce: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer_out`` (dense attention) of one layer, then ``layer_qkv`` of the next with RoPE, as one
    function (see ``layer_post_qkv``). q .. bias as in ``decode_attention``; hidden, weights,
    next_weights, cos, sin, reduce as in ``layer_post_qkv``. Returns hidden [B, Hd] and the next q, k, v."""
    attention = decode_attention(q, prefix_k, prefix_v, own_k, own_v, bias, shape)
    return layer_post_qkv(hidden, attention, weights, next_weights, cos, sin, shape, True, reduce)


def step_inputs(
    token: torch.Tensor,
    positions: torch.Tensor,
    embedding: torch.Tensor,
    inv_freq: torch.Tensor,
    scale: float,
    embed: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's embedded tokens hidden [B, Hd] (rows ``token`` int64 [B] of ``embedding`` [V, Hd]) and
    its rotary tables cos, sin [B, D] in the model's dtype (``rope_tables`` of ``positions``). Under
    tensor parallelism ``embedding`` holds this rank's vocabulary rows [V/tp, Hd] and ``embed(token,
    embedding)`` (``EngineShard.head.embed``) looks them up and sums over the group."""
    hidden = F.embedding(token, embedding) if embed is None else embed(token, embedding)
    return (hidden, *rope_tables(positions, inv_freq, scale, embedding.dtype))


def step_logits(
    hidden: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Logits [B, V] of the last layer's hidden [B, Hd]: final RMSNorm (weight ``norm``), LM head."""
    return F.linear(rms_norm(hidden, norm, eps), head, bias)


class LayerFns(NamedTuple):
    """The decode step's functions, eager or compiled: ``inputs`` (embedding, rotary tables); the first
    layer's ``qkv``; per layer, with the dense attention ``out`` (attention + post) or with the fused one
    ``post``; for every layer but the last, ``out_qkv``/``post_qkv``, which run the next layer's ``qkv``
    in the same function; ``logits`` (final norm, LM head)."""

    inputs: Callable
    qkv: Callable
    out: Callable
    post: Callable
    out_qkv: Callable
    post_qkv: Callable
    logits: Callable


ATTENTION_BACKENDS = DECODE_ATTENTION
EAGER_LAYER_FNS = LayerFns(
    step_inputs, layer_qkv, layer_out, layer_post, layer_out_qkv, layer_post_qkv, step_logits
)


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings.

    Fields: temperature (0 = greedy), top_p in (0, 1], top_k (0 = off), max_tokens R (response budget),
    eos_ids (any of them ends a response), pad_id (fills finished rows), banned_ids int64 [k],
    eos_check_every (decode steps per round; the host checks "every row finished" once per round),
    cuda_graphs (replay the decode step as CUDA graphs), compile (torch.compile the step
    before capture; CUDA only), compile_mode (its torch.compile mode, config.COMPILE_MODES; ValueError
    otherwise), graph_window (own-key window granularity of the captured steps, tokens; 0 = the
    attention's own: ``resolve_graph_window``; ValueError if negative),
    attention (decode attention backend, "auto", "dense" or "triton"; ``StaticDecoder``),
    fused_projections (one q/k/v and one gate/up product per layer from concatenated weight copies),
    fused_sampling (the decode steps' sampling race as Triton kernels, rollout.sample_kernel; on CUDA,
    elsewhere the eager race: ``fused_sampling_runs``), fused_gate (with fused_projections, the gate/up
    product and its SiLU gate as one Triton kernel, rollout.linear_kernel; on CUDA, ``fused_gate_runs``,
    for at most linear_kernel.MAX_ROWS rows; elsewhere, or without fused_projections, ignored).
    """

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    eos_ids: tuple[int, ...]
    pad_id: int
    banned_ids: torch.Tensor
    eos_check_every: int = 16
    cuda_graphs: bool = True
    compile: bool = False
    compile_mode: str = "default"
    graph_window: int = 0
    attention: str = "auto"
    fused_projections: bool = False
    fused_sampling: bool = False
    fused_gate: bool = False

    @classmethod
    def from_config(
        cls, rollout, eos_ids: tuple[int, ...], pad_id: int, banned_ids: torch.Tensor
    ) -> SamplingParams:
        """Settings of a ``RolloutConfig`` (config.rollout) with the model's special ids."""
        return cls(
            rollout.temperature,
            rollout.top_p,
            rollout.top_k,
            rollout.max_response_tokens,
            eos_ids,
            pad_id,
            banned_ids,
            cuda_graphs=rollout.cuda_graphs,
            compile=rollout.compile_decode,
            compile_mode=rollout.compile_mode,
            graph_window=rollout.graph_window,
            attention=rollout.decode_attention,
            fused_projections=rollout.fused_projections,
            fused_sampling=rollout.fused_sampling,
            fused_gate=rollout.fused_gate,
        )

    def __post_init__(self) -> None:
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"decode compile mode {self.compile_mode!r}: expected one of {COMPILE_MODES}")
        if self.graph_window < 0:
            raise ValueError(
                f"decode graph window {self.graph_window!r}: expected >= 0 (0 = the attention's own)"
            )

    @property
    def score_temperature(self) -> float:
        """Temperature of the log-prob definition: the sampling temperature, 1.0 when greedy."""
        return self.temperature if self.temperature > 0 else 1.0

    @property
    def steps_per_round(self) -> int:
        """Decode steps per round of the decode loop (``eos_check_every``, at least 1)."""
        return max(1, self.eos_check_every)

    def race_options(self) -> dict:
        """The keyword arguments of ``rollout.sampler.race_tokens`` (and ``sample_tokens``) these
        settings give."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "banned_ids": self.banned_ids,
        }

    def sample(self, logits: torch.Tensor, generator=None, race=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens int64 [B], log-probs float32 [B]) of logits [B, V] under these settings
        (rollout.sampler.sample_tokens, ``race`` as there); no host synchronisation, so it can be
        captured."""
        return sample_tokens(logits, generator=generator, race=race, **self.race_options())


def decode_steps(params: SamplingParams) -> tuple[int, int]:
    """(rounds, steps) of the decode loop at most: the R − 1 tokens after the first one, in rounds of
    K = ``eos_check_every`` steps (the last round runs the steps left)."""
    steps = max(0, params.max_tokens - 1)
    return -(-steps // params.steps_per_round), steps


@dataclass
class DecodeRecord:
    """What rollout records, in static device buffers written by the decode steps themselves.

    Fields: responses int64 [B, R] (``pad_id`` after a row's end), logprobs float32 [B, R] (0 after a
    row's end), lengths int64 [B] (R until the row samples an EOS id), done bool [B], ``eos`` int64 [k].
    """

    responses: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    done: torch.Tensor
    eos: torch.Tensor
    pad_id: int

    @classmethod
    def empty(cls, rows: int, params: SamplingParams, device, dtype) -> DecodeRecord:
        """Buffers of ``rows`` rows and R columns, nothing recorded yet."""
        width = params.max_tokens
        return cls(
            responses=torch.full((rows, width), params.pad_id, dtype=torch.long, device=device),
            logprobs=torch.zeros(rows, width, dtype=dtype, device=device),
            lengths=torch.full((rows,), params.max_tokens, dtype=torch.long, device=device),
            done=torch.zeros(rows, dtype=torch.bool, device=device),
            eos=torch.tensor(params.eos_ids, dtype=torch.long, device=device),
            pad_id=params.pad_id,
        )

    def write(self, token: torch.Tensor, logprob: torch.Tensor, position: torch.Tensor) -> None:
        """Record tokens int64 [B] and their log-probs [B] at response position ``position`` (int64 [1],
        on the device, < R): finished rows get pad / 0; a row whose token is an EOS id ends there
        (length = position + 1). Device ops only (capturable)."""
        self.responses.index_copy_(1, position, torch.where(self.done, self.pad_id, token)[:, None])
        self.logprobs.index_copy_(1, position, torch.where(self.done, 0.0, logprob)[:, None])
        is_eos = (token[:, None] == self.eos[None, :]).any(dim=-1)
        finished = ~self.done & is_eos
        self.lengths.copy_(torch.where(finished, position + 1, self.lengths))
        self.done.logical_or_(finished)


class StaticDecoder:
    """The rollout's decode loop on the device, over static buffers.

    One decode step: the forward of each row's current token (its keys/values go into the cache),
    sampling of the next token on the device (``SamplingParams.sample``) and recording it
    (``DecodeRecord.write``). ``advance()`` runs a round of ``eos_check_every`` steps; on CUDA with
    graphs, that many replays of the step's CUDA graph (one graph per own-key window), queued with no
    host work per token beyond the launch.
    Steps are counted on the device: step s consumes the token at response position s and records
    position s + 1.

    Args:
        model: ``Qwen2_5_VLForConditionalGeneration`` (its language model and LM head are used).
        prefix: detached rollout prefix of the G groups (boundary KV [G, Hkv, P, D] per layer).
        group_size: N. params: budget R, sampling and decode options (``SamplingParams``).
        record: the buffers the steps write, R columns wide.
        generator: device generator of the sampling (None: the default one); on CUDA with graphs it is
            registered with every captured graph, so replays draw the numbers eager steps would.
        token: int64 [B], the token at response position 0 (sampled from the prefix).
        shard: this process's part of a rollout decoded by several (``EngineShard``), or None: the
            layer tensors, embedding and LM head come from its shared weights (fused views, no copy),
            head counts are per rank, the row-parallel products are summed by its head's
            ``all_reduce``, and sampling races this engine's rows of the whole rollout's noise.

    Raises:
        ValueError: the model's MLP activation is not SiLU (the only one Qwen2.5-VL uses), sliding-
            window attention is on (the step attends to every key), an unknown or unavailable
            attention backend, or a record narrower than the steps need.
    """

    def __init__(
        self,
        model,
        prefix: PrefixState,
        group_size: int,
        params: SamplingParams,
        record: DecodeRecord,
        token: torch.Tensor,
        generator: torch.Generator | None = None,
        shard: EngineShard | None = None,
    ):
        lm = model.model.language_model
        config = lm.config
        if config.hidden_act != "silu":
            raise ValueError(f"decode supports hidden_act 'silu', got {config.hidden_act!r}")
        if getattr(config, "use_sliding_window", False):
            raise ValueError("decode attends to every key; the model config has use_sliding_window on")
        self.steps_per_round = params.steps_per_round
        self.rounds_total, self.steps_total = decode_steps(params)
        if record.responses.shape[1] < self.steps_total + 1:
            raise ValueError(
                f"decode record has {record.responses.shape[1]} columns, needs {self.steps_total + 1}"
            )
        keys = prefix.keys[0]
        head = shard.head if shard is not None else None
        fused = params.fused_projections or shard is not None  # a shard's views are fused, copy-free
        self.shape = DecodeShape(
            groups=keys.shape[0],
            group_size=group_size,
            heads=head.heads if head is not None else config.num_attention_heads,
            kv_heads=keys.shape[1],
            head_dim=keys.shape[3],
            budget=max(1, self.steps_total),
            scaling=float(lm.layers[0].self_attn.scaling),
            eps=float(lm.layers[0].input_layernorm.variance_epsilon),
            gated_kernel=params.fused_gate
            and fused
            and fused_gate_runs(keys.device)
            and keys.shape[0] * group_size <= GATE_MAX_ROWS,
        )
        self.model, self.prefix, self.params, self.record = model, prefix, params, record
        self.generator, self.shard = generator, shard
        self.reduce = head.all_reduce if head is not None else None
        self.embed = head.embed if head is not None else None
        if shard is None:
            self.weights = [_layer_tensors(layer, params.fused_projections) for layer in lm.layers]
        else:
            self.weights = [shard.weights.decode_tensors(i) for i in range(len(lm.layers))]
        self.inv_freq, self.rope_scale = lm.rotary_emb.inv_freq, float(lm.rotary_emb.attention_scaling)
        rows, device = self.shape.rows, keys.device
        cache_shape = (rows, self.shape.kv_heads, self.shape.budget, self.shape.head_dim)
        self.cache_k = [torch.zeros(cache_shape, dtype=keys.dtype, device=device) for _ in self.weights]
        self.cache_v = [torch.zeros(cache_shape, dtype=keys.dtype, device=device) for _ in self.weights]
        self.token = token.to(device=device, dtype=torch.long).clone()
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)
        self.first_position = prefix.next_position.repeat_interleave(group_size)
        self.prompt_lens_i32 = prefix.prompt_lens.to(torch.int32)
        p = keys.shape[2]
        pad = torch.arange(p, device=device)[None, :] >= prefix.prompt_lens[:, None]
        self.prefix_bias = torch.zeros(rows, p, device=device).masked_fill(
            pad.repeat_interleave(group_size, 0), NEG_INF
        )
        use_cuda = device.type == "cuda"
        self.attention = _check_attention(params.attention, device, self.shape)
        self.window = min(resolve_graph_window(params.graph_window, self.attention), self.shape.budget)
        self.layer_fns: LayerFns = EAGER_LAYER_FNS
        self.race: Callable = race_tokens
        if params.fused_sampling and fused_sampling_runs(device) and head is None:
            self.race = sample_kernel.fused_race
        if head is not None:
            self.race = head.race
        if params.compile and use_cuda:
            self.layer_fns = _compiled_layer(params.compile_mode)
        self.use_graphs = params.cuda_graphs and use_cuda
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.rounds = 0
        self.steps_done = 0  # host count of decode steps queued

    def own_window(self, step: int) -> int:
        """Own-key window L for the token at ``step``: the smallest multiple of ``window`` > step (≤ the
        cache length)."""
        return min(self.shape.budget, (step // self.window + 1) * self.window)

    def round_window(self, index: int) -> int:
        """Own-key window of every step of round ``index``: that of its last step (windows only grow)."""
        return self.own_window(min((index + 1) * self.steps_per_round, self.steps_total) - 1)

    def _forward(self, length: int) -> torch.Tensor:
        """Logits [B, V] of the token in ``self.token`` at response position ``self.step_index``.

        Each layer function but the last also runs the next layer's norm and q/k/v products
        (``LayerFns``). With the fused attention, q and the step's key reach the kernel before RoPE and
        it rotates them, and writes the step's key/value into the cache itself."""
        lm, s, fns = self.model.model.language_model, self.shape, self.layer_fns
        positions = self.first_position + self.step_index
        embedding = lm.embed_tokens.weight if self.shard is None else self.shard.weights.embedding()
        rope = (self.inv_freq, self.rope_scale)
        hidden, cos, sin = fns.inputs(self.token, positions, embedding, *rope, self.embed)
        fused = self.attention == "triton"
        bias = None if fused else self._bias(length)
        q, k, v = fns.qkv(hidden, cos, sin, self.weights[0], s, not fused)
        for i, weights in enumerate(self.weights):
            own_k, own_v = self.cache_k[i][:, :, :length], self.cache_v[i][:, :, :length]
            keys, values = self.prefix.keys[i], self.prefix.values[i]
            nxt = self.weights[i + 1] if i + 1 < len(self.weights) else None
            if fused:
                lens, step = self.prompt_lens_i32, self.step_index
                attention = fused_decode_attention(
                    q, keys, values, lens, own_k, own_v, k, v, step, s.scaling, s.group_size,
                    cos=cos, sin=sin, own_chunk=OWN_CHUNK,  # resolve_graph_window's chunk
                )  # fmt: skip
                if nxt is None:
                    hidden = fns.post(hidden, attention, weights, s, self.reduce)
                else:
                    hidden, q, k, v = fns.post_qkv(
                        hidden, attention, weights, nxt, cos, sin, s, False, self.reduce
                    )
            else:
                own_k.index_copy_(2, self.step_index, k[:, :, None])
                own_v.index_copy_(2, self.step_index, v[:, :, None])
                attend = (hidden, q, keys, values, own_k, own_v, bias, weights)
                if nxt is None:
                    hidden = fns.out(*attend, s, self.reduce)
                else:
                    hidden, q, k, v = fns.out_qkv(*attend, nxt, cos, sin, s, self.reduce)
        head = self.model.lm_head
        weight, bias = (
            (head.weight, head.bias) if self.shard is None else (self.shard.weights.lm_head(), None)
        )
        return fns.logits(hidden, lm.norm.weight, weight, bias, float(lm.norm.variance_epsilon))

    def _bias(self, length: int) -> torch.Tensor:
        """Additive mask float32 [B, 1, 1, P + L] of the dense attention: prompt padding and own slots
        after the current token at -inf."""
        own = torch.arange(length, device=self.step_index.device)[None, :] <= self.step_index
        own_bias = torch.where(own, 0.0, NEG_INF).expand(self.shape.rows, -1)
        return torch.cat([self.prefix_bias, own_bias], dim=1)[:, None, None, :]

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens int64 [B] and log-probs float32 [B] of this step's logits [B, V] (or this rank's
        vocabulary columns [B, V/tp]): ``SamplingParams.sample``, or with a shard its rows of the whole
        rollout's noise (``EngineShard``)."""
        if self.shard is None:
            return self.params.sample(logits, self.generator, self.race)
        rows = (self.shard.first_row, self.shard.total_rows)
        options = self.params.race_options()
        return sample_rows(
            logits, rows=rows, vocab=self.shard.vocab, generator=self.generator, race=self.race, **options
        )

    def finished(self) -> torch.Tensor:
        """bool []: every row has ended (with a shard: every engine's rows; a collective)."""
        done = self.record.done.all()
        return done if self.shard is None else self.shard.all_finished(done)

    def _step(self, length: int) -> None:
        """One decode step on the device: forward, sample, record position step + 1, advance."""
        token, logprob = self._sample(self._forward(length))
        self.step_index += 1
        self.record.write(token, logprob, self.step_index)
        self.token.copy_(token)

    @torch.no_grad()
    def capture(self) -> None:
        """Warm up and capture one CUDA graph of one decode step per own-key window (no-op
        without graphs). Call before other threads put work on the device: capture must not
        interleave with their allocations.

        Graphs are captured on a stream of the current stream's priority, one per priority for the
        process, so captures take a module lock and run one at a time. PyTorch instantiates graphs
        with per-node priorities, so replayed kernels keep the priority of the stream they were
        captured on (not the one they are replayed on). Warm-up runs the forward (it overwrites cache
        slot 0, which step 0 writes again) and the sampling race on noise of ones: it draws no random
        numbers and records nothing.

        Raises:
            RuntimeError: this torch cannot register a generator with a CUDA graph.
        """
        if not self.use_graphs or self.rounds_total == 0:
            return
        lengths = sorted({self.round_window(r) for r in range(self.rounds_total)})
        current = torch.cuda.current_stream(self.token.device)
        with _CAPTURE_LOCK:  # the capture stream is shared: one capture at a time
            self._capture_on(_capture_stream(self.token.device, current.priority), current, lengths)

    def _capture_on(self, warm: torch.cuda.Stream, current: torch.cuda.Stream, lengths: list[int]) -> None:
        """``capture``'s warm-up and capture of the windows ``lengths`` on the stream ``warm``, ordered
        after and before ``current``."""
        warm.wait_stream(current)
        with torch.cuda.stream(warm):
            for length in lengths:  # compilation, cuBLAS handles and workspaces happen here
                logits = self._forward_or_eager(length)
            self._warm_race(logits)
        warm.synchronize()
        # capture_begin/end rather than torch.cuda.graph, which empties the allocator's cache per capture;
        # one fresh pool per rollout, shared by its windows (a pool id reused after its graphs are freed
        # trips the device and host allocators' use-count checks in torch 2.11)
        pool = None
        with torch.cuda.stream(warm):
            for length in lengths:
                graph = torch.cuda.CUDAGraph()
                if self.generator is not None:
                    if not hasattr(graph, "register_generator_state"):
                        raise RuntimeError("capturing sampling with a generator needs torch >= 2.5")
                    graph.register_generator_state(self.generator)
                graph.capture_begin(pool=pool)
                try:
                    self._step(length)
                finally:
                    graph.capture_end()
                pool = graph.pool()
                self._graphs[length] = graph
        current.wait_stream(warm)

    def _forward_or_eager(self, length: int) -> torch.Tensor:
        """``_forward``, falling back to the eager layer function if the compiled one fails to build."""
        try:
            return self._forward(length)
        except Exception as err:  # noqa: BLE001 - any compiler failure leaves a working eager path
            if self.layer_fns == EAGER_LAYER_FNS:
                raise
            log.warning("compiled decode step failed (%s: %s); using the eager step", type(err).__name__, err)
            self.layer_fns = EAGER_LAYER_FNS
            return self._forward(length)

    def _warm_race(self, logits: torch.Tensor) -> None:
        """Build the fused sampling race's kernels before capture, on noise of ones (no random numbers
        drawn); a failure falls back to the eager race with a warning."""
        p = self.params
        vocab = self.shard.vocab if self.shard is not None else logits.shape[1]
        noise = None if p.temperature == 0 else logits.new_ones((logits.shape[0], vocab), dtype=torch.float32)
        try:
            self.race(logits, noise, **p.race_options())
        except Exception as err:  # noqa: BLE001 - any compiler failure leaves a working eager path
            if self.race is not sample_kernel.fused_race:
                raise
            log.warning("fused sampling failed (%s: %s); using the eager race", type(err).__name__, err)
            self.race = race_tokens

    @torch.no_grad()
    def advance(self) -> int:
        """Run the next ``steps_per_round`` decode steps (the last round: the steps left), as that many
        graph replays or eager steps, which draw the same random numbers; returns the number of steps
        run so far. Queues device work only.

        Raises:
            RuntimeError: every round has run, or graphs are on and ``capture()`` has not run
                (capturing here, possibly while another thread uses the device, is never done
                implicitly).
        """
        if self.rounds >= self.rounds_total:
            raise RuntimeError(f"all {self.rounds_total} decode rounds have run")
        length = self.round_window(self.rounds)
        steps = min(self.steps_per_round, self.steps_total - self.steps_done)
        if self.use_graphs:
            if length not in self._graphs:
                raise RuntimeError(
                    f"no captured decode graph for own-key window {length}: call capture() first"
                )
            for _ in range(steps):
                self._graphs[length].replay()
        else:
            for _ in range(steps):
                self._step(length)
        self.rounds += 1
        self.steps_done += steps
        return self.steps_done


_CAPTURE_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}
_CAPTURE_LOCK = threading.Lock()


def _capture_stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    """The stream decode graphs are warmed up and captured on, one per (device, priority) for the life
    of the process: cuBLAS keeps a workspace per (handle, stream) until exit, so a fresh stream per
    rollout would leave one more workspace behind each time (until torch's pool of 32 streams repeats).
    Only ``StaticDecoder.capture`` uses it, under ``_CAPTURE_LOCK``, so captures run one at a time."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, priority)
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(index, priority=priority)
    return _CAPTURE_STREAMS[key]


_COMPILED: dict[str, LayerFns] = {}


def _compiled_layer(mode: str = "default") -> LayerFns:
    """The layer functions (``LayerFns``) under torch.compile in ``mode`` (config.COMPILE_MODES;
    "max-autotune" is inductor's max-autotune without its own CUDA graphs, since the decoder captures the
    whole step itself), built once per process and mode, max-autotune on copies of the functions with
    code objects of their own (the cache write between them stays outside, so compiled code never
    mutates its inputs). The first
    own-key window compiles for static shapes; a second window or prompt length recompiles once with
    symbolic sizes.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"decode compile mode {mode!r}: expected one of {COMPILE_MODES}")
    if mode not in _COMPILED:
        fns = EAGER_LAYER_FNS
        if mode != "default":  # dynamo's recompile limit counts per code object: one per mode
            fns = LayerFns(*(_with_own_code(fn, mode) for fn in fns))
        options = {} if mode == "default" else {"mode": "max-autotune-no-cudagraphs"}
        _COMPILED[mode] = LayerFns(*(torch.compile(fn, **options) for fn in fns))
    return _COMPILED[mode]


def _with_own_code(fn: Callable, tag: str) -> Callable:
    """A copy of the plain function ``fn`` with a code object of its own (named fn_tag), so that
    torch.compile's caches and recompile limit, kept per code object, are not shared with ``fn``."""
    name = f"{fn.__name__}_{tag.replace('-', '_')}"
    names = {"co_name": name, **({"co_qualname": name} if hasattr(fn.__code__, "co_qualname") else {})}
    code = fn.__code__.replace(**names)
    copy = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__doc__ = name, fn.__doc__
    copy.__kwdefaults__, copy.__annotations__ = fn.__kwdefaults__, dict(fn.__annotations__)
    return copy


def fused_sampling_runs(device: torch.device) -> bool:
    """Whether ``fused_sampling`` takes effect on ``device``: on CUDA where Triton is installed. (On the
    CPU the eager race runs: Triton's interpreter would be far slower; tests/rollout checks the fused
    race there directly, and a rollout test forces it through this function.)"""
    return device.type == "cuda" and sample_kernel.triton is not None


def fused_gate_runs(device: torch.device) -> bool:
    """Whether ``fused_gate`` takes effect on ``device``: on CUDA where Triton is installed (on the CPU the
    cuBLAS-style product and SiLU run; tests/rollout checks the kernel there through Triton's interpreter,
    and a rollout test forces it through this function)."""
    return device.type == "cuda" and triton is not None


def _triton_runs(device: torch.device) -> bool:
    """Triton kernels can run on tensors of ``device``: CUDA, or the CPU under ``TRITON_INTERPRET=1``."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _check_attention(name: str, device: torch.device, shape: DecodeShape) -> str:
    """The attention backend name, checked, "auto" resolved: triton on CUDA where the kernel supports
    the model's heads (decode_kernel.supports), else dense (see ``StaticDecoder``)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"decode attention {name!r}: expected one of {ATTENTION_BACKENDS}")
    if name == "auto":
        usable = device.type == "cuda" and supports(shape.heads, shape.kv_heads, shape.head_dim)
        return "triton" if usable else "dense"
    if name == "triton" and not _triton_runs(device):
        raise BackendUnavailable(
            "decode attention 'triton' runs on CUDA (or on the CPU under TRITON_INTERPRET=1)"
        )
    return name

"""The attention function rollplex registers with transformers: prefix recording and shared-prefix suffixes.

Legend: B rows (= G·N), G groups, N group size, H query heads, Hkv key/value heads, Q query length,
P_max padded prefix length, S suffix key length, D head dim.

One function serves two modes, chosen by the plan object passed down the model's forward as the
keyword ``rollplex_plan`` (transformers forwards unknown keywords to the attention interface):

    PrefixPlan   prompt prefill of one group: causal attention; the layer's keys/values (after RoPE)
                 are recorded as boundary KV, attached to autograd when the caller is.
    SuffixPlan   N responses per group attend to their group's boundary KV and causally to their own
                 tokens. Used for reference/actor scoring.

Decode (one new token per row) has its own static-shape step in rollout.decode.

The suffix math is exact: scores against the prefix and against the suffix are concatenated before a
single softmax, which is the same arithmetic a full-sequence causal forward performs. This dense path
runs on any device; it is the reference the faster paths are tested against.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.attention.bias import causal_lower_right

from rollplex.config import cascade_kernel_names
from rollplex.models.compiled import compile_error_text, compile_errors, compile_fallback
from rollplex.models.transfer import stream_key, to_device
from rollplex.types import PrefixState

log = logging.getLogger("rollplex")

ATTENTION_NAME = "rollplex"
PLAN_KEYWORD = "rollplex_plan"  # the keyword argument that carries the plan down to the attention


@dataclass
class PrefixPlan:
    """Records boundary KV of a single-prompt prefill while ``recording``: ``keys[l]``, ``values[l]``
    are [1, Hkv, P, D] (the model's dtype)."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    recording: bool = True

    def take_boundary(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The recorded (keys, values), each a list over the layers recorded, in layer order, each
        [1, Hkv, P, D]; leaves the plan empty and no longer recording (a second call returns two empty
        lists).

        Under torch's activation checkpoint the plan is one of the layers' keyword arguments, which
        each layer's recompute closure keeps, and the autograd graph keeps the closures (layer
        recompute, ``models.recompute``, gives each layer a plan of its own and keeps none). A boundary tensor
        left in the plan, or one a recompute in backward records there, would close a cycle through
        that graph, which Python's collector cannot see into: an attached prefix dropped without its
        backward pass (a step that raised after the pass and before the actor's backward), or kept for
        a second backward (``retain_graph``), would never free its memory.
        """
        keys = [self.keys[i] for i in range(len(self.keys))]
        values = [self.values[i] for i in range(len(self.values))]
        self.clear()
        return keys, values

    def clear(self) -> None:
        """Drop what was recorded and stop recording (a prefill that raised: see ``take_boundary``)."""
        self.keys.clear()
        self.values.clear()
        self.recording = False


@dataclass
class SuffixPlan:
    """Shared-prefix scoring of responses.

    Fields:
        prefix_keys, prefix_values: per layer [G, Hkv, P_max, D].
        prefix_lens: int64 [G]; keys at index >= prefix_lens[g] are padding.
        group_size: N; query row b belongs to group b // N.
        backend: "dense" (exact reference, any device), "causal" (per group, one SDPA call over the N
            responses, each against [its group's boundary KV ; its own keys] with a bottom-right causal
            mask: flash attention on CUDA, see ``causal_shared_prefix_attention``), "cascade" (each
            response's queries against its group's boundary KV, unmasked, and against its own keys,
            causally, merged by log-sum-exp: ``cascade_shared_prefix_attention``), "sdpa" (one masked
            SDPA call per layer over [boundary KV ; all N responses' keys]) or "flex" (flex_attention).
        mask: the backend's mask — None (dense, causal, cascade), bool [G, 1, N·R, P_max + N·R] (sdpa, see
            ``suffix_bool_mask``) or a flex BlockMask (``suffix_block_mask``).
        host_prompt_lens: the G prompt lengths on the host (causal and cascade slice each group's
            boundary by them).
        cascade_kernels: the cascade backend's kernels, "BOUNDARY,OWN" or "auto" (``cascade_kernels``).
    """

    prefix_keys: list[torch.Tensor]
    prefix_values: list[torch.Tensor]
    prefix_lens: torch.Tensor
    group_size: int
    backend: str = "dense"
    mask: object | None = None
    host_prompt_lens: tuple[int, ...] = ()
    cascade_kernels: str = "auto"


@dataclass(frozen=True)
class SuffixAttention:
    """How responses attend to their prompt's keys when they are scored: ``backend``
    (``model.suffix_attention``: auto = the device and dtype's default, ``models.forward.suffix_backend``)
    and, for the cascade backend, its kernels (``model.cascade_kernels``: auto or "BOUNDARY,OWN",
    ``cascade_kernels``).

    Example:
        SuffixAttention("cascade", "flash,flash")   # cascade, flash attention for both parts
    """

    backend: str = "auto"
    cascade_kernels: str = "auto"


def suffix_plan(
    prefix: PrefixState, group_size: int, length: int, backend: str, cascade_kernels: str = "auto"
) -> SuffixPlan:
    """The ``SuffixPlan`` of responses scored against ``prefix``: ``length`` suffix positions per response
    (R), ``group_size`` responses per group (N), with ``backend``'s mask (``SuffixPlan.mask``) made once
    for all layers, and the cascade backend's ``cascade_kernels`` ("BOUNDARY,OWN" or "auto").

    Raises:
        ValueError: ``backend`` is not one of ``SUFFIX_ATTENTION``.
    """
    if backend not in SUFFIX_ATTENTION:
        raise ValueError(f"suffix attention {backend!r}: expected one of {tuple(SUFFIX_ATTENTION)}")
    plan = SuffixPlan(
        prefix.keys,
        prefix.values,
        prefix.prompt_lens,
        group_size,
        backend,
        host_prompt_lens=prefix.host_prompt_lens,
        cascade_kernels=cascade_kernels,
    )
    p_max = prefix.keys[0].shape[2]
    if backend == "sdpa":
        allowed = suffix_bool_mask(prefix.prompt_lens, p_max, group_size, length)
        plan.mask = suffix_additive_mask(allowed, prefix.keys[0].dtype)
    elif backend == "flex":
        plan.mask = suffix_block_mask(prefix.prompt_lens, p_max, group_size, length)
    return plan


def rollplex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention interface entry point (transformers ``AttentionInterface`` contract).

    Args:
        query: [B, H, Q, D] after RoPE; key, value: [B, Hkv, Q, D] of the new tokens.
        attention_mask: ignored (always None here: masks are implied by the plan).
        kwargs["rollplex_plan"]: PrefixPlan | SuffixPlan.

    Returns:
        (output [B, Q, H, D], None).

    Raises:
        KeyError: no plan was passed (the model was called outside rollplex's forward functions).
    """
    plan = kwargs[PLAN_KEYWORD]
    layer = module.layer_idx
    if isinstance(plan, PrefixPlan):
        if plan.recording:  # not in torch's checkpoint recompute (PrefixPlan.take_boundary)
            plan.keys[layer], plan.values[layer] = key, value
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2), None
    return SUFFIX_ATTENTION[plan.backend](query, key, value, plan, layer, scaling), None


def shared_prefix_attention(
    query: torch.Tensor,
    own_keys: torch.Tensor,
    own_values: torch.Tensor,
    plan: SuffixPlan,
    layer: int,
    scaling: float,
) -> torch.Tensor:
    """Dense exact attention of suffix queries over [group prefix ; own tokens].

    Args:
        query: [B, H, Q, D]; own_keys/own_values: [B, Hkv, Q, D]; query i sees own keys 0..i.
        plan: carries the group's boundary KV [G, Hkv, P_max, D] and prefix lengths.

    Returns:
        [B, Q, H, D].
    """
    n = plan.group_size
    b, h, q_len, d = query.shape
    g, hkv, p_max, _ = plan.prefix_keys[layer].shape
    rep = h // hkv
    q6 = query.reshape(g, n, hkv, rep, q_len, d)
    prefix_k, prefix_v = plan.prefix_keys[layer], plan.prefix_values[layer]
    s_prefix = torch.einsum("gnkrqd,gkpd->gnkrqp", q6, prefix_k) * scaling
    pad = torch.arange(p_max, device=query.device)[None, :] >= plan.prefix_lens[:, None]
    s_prefix = s_prefix.masked_fill(pad[:, None, None, None, None, :], float("-inf"))
    own_k6 = own_keys.reshape(g, n, hkv, 1, -1, d)
    s_own = torch.einsum("gnkrqd,gnkzsd->gnkrqs", q6, own_k6) * scaling
    s_len = own_keys.shape[2]
    future = (
        torch.arange(s_len, device=query.device)[None, :]
        > (torch.arange(q_len, device=query.device)[:, None])
    )
    s_own = s_own.masked_fill(future, float("-inf"))
    softmax_dtype = torch.promote_types(query.dtype, torch.float32)
    probs = torch.softmax(torch.cat([s_prefix, s_own], dim=-1), dim=-1, dtype=softmax_dtype).to(query.dtype)
    p_prefix, p_own = probs.split([p_max, s_len], dim=-1)
    out = torch.einsum("gnkrqp,gkpd->gnkrqd", p_prefix, prefix_v)
    out = out + torch.einsum("gnkrqs,gnkzsd->gnkrqd", p_own, own_values.reshape(g, n, hkv, 1, -1, d))
    return out.reshape(b, h, q_len, d).transpose(1, 2)


_compiled_flex = None


def _flex():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def suffix_block_mask(prefix_lens: torch.Tensor, p_max: int, group_size: int, length: int):
    """flex_attention BlockMask of G groups, each query block = N suffixes of ``length`` tokens.

    Keys of group g are [boundary KV (P_max, valid < prefix_lens[g]) ; the N suffixes' own keys]; query
    (n, r) sees every valid prefix key and the keys (n, 0..r) of its own suffix.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    lens = prefix_lens

    def mask_mod(b, h, q_idx, kv_idx):
        in_prefix = kv_idx < p_max
        j = kv_idx - p_max
        own = (j // length == q_idx // length) & (j % length <= q_idx % length)
        return (in_prefix & (kv_idx < lens[b])) | (~in_prefix & own)

    n_r = group_size * length
    return create_block_mask(mask_mod, lens.shape[0], None, n_r, p_max + n_r, device=lens.device)


def _fold(x: torch.Tensor, groups: int, n: int) -> torch.Tensor:
    """[G·N, heads, R, D] → [G, heads, N·R, D]: the N suffixes of a group as one sequence."""
    _, heads, r, d = x.shape
    return x.reshape(groups, n, heads, r, d).permute(0, 2, 1, 3, 4).reshape(groups, heads, n * r, d)


def _unfold(x: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """[G, H, N·R, D] → [G·N, R, H, D]."""
    g, h, _, d = x.shape
    return x.reshape(g, h, n, r, d).permute(0, 2, 3, 1, 4).reshape(g * n, r, h, d)


def suffix_bool_mask(prefix_lens: torch.Tensor, p_max: int, group_size: int, length: int) -> torch.Tensor:
    """bool [G, 1, N·R, P_max + N·R], True where query (n, r) of group g may attend: valid prefix keys
    (index < prefix_lens[g]) and keys (n, 0..r) of its own suffix."""
    device = prefix_lens.device
    q = torch.arange(group_size * length, device=device)
    kv = torch.arange(p_max + group_size * length, device=device)
    j = kv - p_max
    own = (
        (j[None, :] >= 0)
        & (j[None, :] // length == q[:, None] // length)
        & (j[None, :] % length <= q[:, None] % length)
    )
    prefix = (kv[None, :] < prefix_lens[:, None]) & (kv[None, :] < p_max)
    return (own[None, :, :] | prefix[:, None, :])[:, None]


def suffix_additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bool mask as an additive mask (0 / -inf) in the attention dtype, built once per suffix pass:
    its key dimension is allocated rounded up to a multiple of 16 and sliced back, so SDPA's masked
    kernels (the memory-efficient kernel among them) use it as is instead of converting and padding a
    copy in every layer."""
    kv = allowed.shape[-1]
    padded = torch.zeros((*allowed.shape[:-1], -(-kv // 16) * 16), dtype=dtype, device=allowed.device)
    mask = padded[..., :kv]
    mask.masked_fill_(~allowed, float("-inf"))
    return mask


def causal_shared_prefix_attention(query, own_keys, own_values, plan: SuffixPlan, layer: int, scaling):
    """Suffix attention as one SDPA call per group and layer: the group's N responses are the batch, and
    each attends to [its group's P_g boundary keys ; its own R keys] under a bottom-right causal mask
    (``torch.nn.attention.bias.causal_lower_right``): response query i sees every boundary key and its
    own keys 0..i, the same keys as a full-sequence causal forward. No mask tensor is read and the
    masked-out block (other responses' keys, a response's later keys) is skipped rather than computed:
    with P_g = 3,920 and N = 8 responses of R = 511, the scores computed fall from N·R × (P_g + N·R)
    to about N·R × (P_g + R/2), a little over half. The boundary is sliced to its P_g valid keys (host
    lengths, no read-back) and copied once per response; the gradient of the N copies sums into the
    group's boundary KV.

    Where flash attention is eligible (CUDA, bf16/fp16, a head dim it supports) the call runs it, with
    the key/value heads as they are (grouped-query attention) and a deterministic backward under
    ``torch.use_deterministic_algorithms``; otherwise SDPA takes another kernel or, as on the CPU, runs
    on the materialised mask: the same arithmetic. (``models.forward.suffix_backend`` picks this backend
    on CUDA for bf16/fp16 only.)

    Args:
        query: [B, H, R, D]; own_keys/own_values: [B, Hkv, R, D]; B = G·N.
        plan: the boundary KV per layer [G, Hkv, P_max, D] and ``host_prompt_lens`` (G lengths).

    Returns:
        [B, R, H, D].

    Raises:
        ValueError: the plan's G host lengths times N is not B.
    """
    n, (b, _, r, _) = plan.group_size, query.shape
    _check_host_lens(plan, b)
    outs = []
    for g, prompt_len in enumerate(plan.host_prompt_lens):
        rows = slice(g * n, (g + 1) * n)
        keys = _with_boundary(plan.prefix_keys[layer], g, prompt_len, own_keys[rows])
        values = _with_boundary(plan.prefix_values[layer], g, prompt_len, own_values[rows])
        mask = causal_lower_right(r, prompt_len + r)
        outs.append(
            F.scaled_dot_product_attention(
                query[rows], keys, values, attn_mask=mask, scale=scaling, enable_gqa=True
            )
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.transpose(1, 2)


def _with_boundary(boundary: torch.Tensor, group: int, prompt_len: int, own: torch.Tensor) -> torch.Tensor:
    """[N, Hkv, prompt_len + R, D]: group ``group``'s first ``prompt_len`` boundary keys (or values) of
    ``boundary`` [G, Hkv, P_max, D], then each response's own R, from ``own`` [N, Hkv, R, D]."""
    n = own.shape[0]
    return torch.cat([boundary[group : group + 1, :, :prompt_len].expand(n, -1, -1, -1), own], dim=2)


def _check_host_lens(plan: SuffixPlan, rows: int) -> None:
    """Raises ValueError unless the plan's G host prompt lengths times N make ``rows``."""
    if len(plan.host_prompt_lens) * plan.group_size != rows:
        raise ValueError(
            f"{len(plan.host_prompt_lens)} host prompt lengths × {plan.group_size} responses != {rows} query rows"
        )


# --- cascade suffix attention: the shared boundary once per group, the own keys per response ---------


@dataclass(frozen=True)
class AttentionKernel:
    """One attention part of ``cascade_shared_prefix_attention``, as a forward that also returns the
    softmax's log-sum-exp and a backward that is given the merged output and log-sum-exp.

    Fields:
        name: "math" (plain PyTorch, any device: the reference), "flash" (flash attention 2) or
            "cudnn" (cuDNN's fused attention), the last two through torch's SDPA operators.
        forward: (q [B, H, Q, D], k, v [B, Hkv, K, D], causal, scale) -> (out [B, H, Q, D] in q's dtype,
            lse [B, H, Q] in natural-log units (float32; float64 for float64 inputs in "math"), aux:
            what the backward needs back).
        backward: (dout, q, k, v, out, lse, aux, causal, scale) -> (dq, dk, dv), where out and lse are
            those of the whole softmax the part belongs to (``_CascadeAttention.backward``).
    Causal is only used with Q == K, where the upper-left and lower-right aligned masks coincide (query
    i sees keys 0..i).
    """

    name: str
    forward: Callable
    backward: Callable


def _to_query_heads(x: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, Hkv, K, D] -> [B, H, K, D] in ``dtype``: each key/value head repeated for its H/Hkv query
    heads (grouped-query attention, as transformers' ``repeat_kv``)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1).to(dtype)


def _math_scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    """Scores [B, H, Q, K] in ``k``'s dtype, of q [B, H, Q, D] against k already on the query heads."""
    s = q.to(k.dtype) @ k.transpose(-1, -2) * scale
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _math_forward(q, k, v, causal: bool, scale: float):
    acc, heads = torch.promote_types(q.dtype, torch.float32), q.shape[1]
    s = _math_scores(q, _to_query_heads(k, heads, acc), causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse[..., None]) @ _to_query_heads(v, heads, acc)).to(q.dtype), lse, ()


def _math_backward(dout, q, k, v, out, lse, aux, causal: bool, scale: float):
    """The softmax attention's gradients given the whole softmax's output and log-sum-exp: with
    P = exp(S − lse) and Δ = rowsum(dO ⊙ O), dV = Pᵀ·dO, dS = P ⊙ (dO·Vᵀ − Δ), dQ = scale·dS·K and
    dK = scale·dSᵀ·Q (Dao, FlashAttention-2, 2023, Algorithm 2), key/value heads summed over their
    query heads."""
    acc, heads = torch.promote_types(q.dtype, torch.float32), q.shape[1]
    kk, vv = _to_query_heads(k, heads, acc), _to_query_heads(v, heads, acc)
    s = _math_scores(q, kk, causal, scale)
    p = torch.exp(s - lse[..., None].to(acc))
    do = dout.to(acc)
    delta = (do * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (do @ vv.transpose(-1, -2) - delta) * scale
    dq = ds @ kk
    dk, dv = ds.transpose(-1, -2) @ q.to(acc), p.transpose(-1, -2) @ do

    def per_kv_head(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(1, (k.shape[1], heads // k.shape[1])).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def _flash_forward(q, k, v, causal: bool, scale: float):
    out, lse, *aux = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    cum_q, cum_k, max_q, max_k, rng_state, unused, _ = aux
    return out, lse, (lse.shape, cum_q, cum_k, max_q, max_k, rng_state, unused)


def _flash_backward(dout, q, k, v, out, lse, aux, causal: bool, scale: float):
    shape, cum_q, cum_k, max_q, max_k, rng_state, unused = aux
    lse = lse.reshape(shape).contiguous()
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale
    )  # fmt: skip


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    out, lse, *aux = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    cum_q, cum_k, max_q, max_k, seed, offset, _ = aux
    return out, lse.reshape(out.shape[:3]), (lse.shape, cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(dout, q, k, v, out, lse, aux, causal: bool, scale: float):
    shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
    lse = lse.reshape(shape).contiguous()
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale
    )  # fmt: skip


# the kernels a cascade part can run, by the name model.cascade_kernels gives them (config.CASCADE_KERNELS)
ATTENTION_KERNELS = {
    "math": AttentionKernel("math", _math_forward, _math_backward),
    "flash": AttentionKernel("flash", _flash_forward, _flash_backward),
    "cudnn": AttentionKernel("cudnn", _cudnn_forward, _cudnn_backward),
}


def cascade_kernels(
    device: torch.device, dtype: torch.dtype, names: str = "auto"
) -> tuple[AttentionKernel, AttentionKernel]:
    """The (boundary part, own part) kernels of the cascade backend. ``names`` (``model.cascade_kernels``)
    is "BOUNDARY,OWN", names of ``ATTENTION_KERNELS``, or "auto": cuDNN's fused attention for the
    boundary and flash attention for the responses' own keys on CUDA in bf16/fp16 (flash attention for
    both under ``torch.use_deterministic_algorithms``: cuDNN's backward does not repeat itself bit for
    bit), the plain-PyTorch reference elsewhere.

    Raises:
        ConfigError (ValueError): ``names`` is neither auto nor two kernel names
            (``config.cascade_kernel_names``).
    """
    parts = cascade_kernel_names(names)
    if parts is None:
        fast = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        boundary = "flash" if torch.are_deterministic_algorithms_enabled() else "cudnn"
        parts = (boundary, "flash") if fast else ("math", "math")
    return ATTENTION_KERNELS[parts[0]], ATTENTION_KERNELS[parts[1]]


def _heads_to_rows(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[N, H, R, ...] -> [N, Hkv, (H/Hkv)·R, ...]: the query heads of each key/value head as one query
    sequence per response (exact for attention without a mask, where a query's position does not
    matter), so the boundary part is a plain multi-head attention with Hkv heads."""
    return x.reshape(x.shape[0], hkv, -1, *x.shape[3:])


def _rows_to_heads(x: torch.Tensor, h: int) -> torch.Tensor:
    """The inverse of ``_heads_to_rows``: [N, Hkv, (H/Hkv)·R, ...] -> [N, H, R, ...]."""
    n, _, rows = x.shape[:3]
    return x.reshape(n, h, rows * x.shape[1] // h, *x.shape[3:])


def _per_response(x: torch.Tensor, n: int) -> torch.Tensor:
    """[1, Hkv, P, D] -> [N, Hkv, P, D], expanded (stride 0 over the responses), not copied: a copy
    made a layer's forward + backward slower (benchmarks/README.md)."""
    return x.expand(n, -1, -1, -1)


def _merge(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax attentions over disjoint key sets as the one over their union: lse = log(e^lse_a +
    e^lse_b) and out = w·out_a + (1 − w)·out_b with w = e^(lse_a − lse) = σ(lse_a − lse_b), in float32
    (float64 for float64 outputs), out in out_a's dtype.

    Args:
        out_a, out_b: [N, H, R, D]; lse_a, lse_b: [N, H, R] (natural-log units).
    """
    acc = torch.promote_types(out_a.dtype, torch.float32)
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    w = torch.sigmoid(lse_a - lse_b)[..., None]
    return torch.lerp(out_b.to(acc), out_a.to(acc), w).to(out_a.dtype), torch.logaddexp(lse_a, lse_b)


_MERGE = {}  # device type -> the merge used there (``_merge_on``)


def _merge_on(device: torch.device) -> Callable:
    """``_merge`` as run on ``device``: compiled by torch.compile on CUDA, where its elementwise
    kernels (four of them over [B, H, R, D]) become one (a shorter layer forward: benchmarks/README.md);
    eager elsewhere,
    and from the first compile error on (logged once), or where the layers' compilation has fallen back
    (``models.compiled.compile_fallback``)."""
    if device.type != "cuda" or compile_fallback() is not None:  # the layers could not compile either
        return _merge
    if device.type not in _MERGE:
        compiled = torch.compile(_merge, dynamic=None)

        def merge(*args):
            try:
                return compiled(*args)
            except compile_errors() as err:
                log.warning("the cascade attention's merge runs uncompiled: %s", compile_error_text(err))
                _MERGE[device.type] = _merge
                return _merge(*args)

        _MERGE[device.type] = merge
    return _MERGE[device.type]


class _CascadeAttention(torch.autograd.Function):
    """One layer's suffix attention as two attentions merged by their log-sum-exps; see
    ``cascade_shared_prefix_attention``. The own part and the merge run once over all B rows, the
    boundary part once per group (its P_g keys)."""

    @staticmethod
    def forward(ctx, query, own_k, own_v, boundary_k, boundary_v, scale, kernels, prompt_lens):
        b, h = query.shape[:2]
        n, hkv, (on_boundary, on_own) = b // len(prompt_lens), boundary_k.shape[1], kernels
        outs, lses, aux_boundary = [], [], []
        for rows, k, v in _group_parts(boundary_k, boundary_v, prompt_lens, n):
            out_g, lse_g, aux = on_boundary.forward(_heads_to_rows(query[rows], hkv), k, v, False, scale)
            outs.append(out_g)
            lses.append(lse_g)
            aux_boundary.append(aux)
        out_own, lse_own, aux_own = on_own.forward(query, own_k, own_v, True, scale)
        out_bd, lse_bd = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))
        merge = _merge_on(query.device)
        out, lse = merge(_rows_to_heads(out_bd, h), _rows_to_heads(lse_bd, h), out_own, lse_own)
        ctx.save_for_backward(query, own_k, own_v, boundary_k, boundary_v, out, lse)
        ctx.scale, ctx.kernels, ctx.prompt_lens = scale, kernels, prompt_lens
        ctx.aux = (aux_boundary, aux_own)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        query, own_k, own_v, boundary_k, boundary_v, out, lse = ctx.saved_tensors
        (on_boundary, on_own), (aux_boundary, aux_own), scale = ctx.kernels, ctx.aux, ctx.scale
        b, h = query.shape[:2]
        n, hkv, dout = b // len(ctx.prompt_lens), boundary_k.shape[1], dout.contiguous()
        dq, d_own_k, d_own_v = on_own.backward(dout, query, own_k, own_v, out, lse, aux_own, True, scale)
        need_k, need_v = ctx.needs_input_grad[3:5]
        d_boundary_k = torch.zeros_like(boundary_k) if need_k else None
        d_boundary_v = torch.zeros_like(boundary_v) if need_v else None
        for g, (rows, k, v) in enumerate(_group_parts(boundary_k, boundary_v, ctx.prompt_lens, n)):
            dq_g, dk_g, dv_g = on_boundary.backward(
                *(_heads_to_rows(x[rows], hkv) for x in (dout, query)), k, v,
                *(_heads_to_rows(x[rows], hkv) for x in (out, lse)), aux_boundary[g], False, scale,
            )  # fmt: skip
            dq[rows] += _rows_to_heads(dq_g, h)  # the two parts' query gradients, each rounded
            if need_k:
                d_boundary_k[g, :, : k.shape[2]] = dk_g.sum(0)  # over the N responses
            if need_v:
                d_boundary_v[g, :, : v.shape[2]] = dv_g.sum(0)
        return dq, d_own_k, d_own_v, d_boundary_k, d_boundary_v, None, None, None


def _group_parts(boundary_k, boundary_v, prompt_lens: tuple[int, ...], n: int):
    """Per group g: (its rows of the batch, its P_g boundary keys and values as the N responses see
    them, [N, Hkv, P_g, D] each: ``_per_response``)."""
    for g, prompt_len in enumerate(prompt_lens):
        k, v = (_per_response(x[g : g + 1, :, :prompt_len], n) for x in (boundary_k, boundary_v))
        yield slice(g * n, (g + 1) * n), k, v


def cascade_shared_prefix_attention(query, own_keys, own_values, plan: SuffixPlan, layer: int, scaling):
    """Suffix attention as two attentions per group and layer, merged by their log-sum-exps (cascade
    or shared-prefix attention decomposition: Juravsky et al., Hydragen, 2024; the merge as in
    FlashInfer's cascade attention and ring attention):

    - the boundary part: each response's queries against the group's P_g boundary keys, without a
      mask, the query heads of a key/value head as one query sequence (``_heads_to_rows``: H/Hkv·R
      queries against P_g keys per key/value head and response), with the boundary expanded over the
      N responses, not copied (``_per_response``), and its gradient summed over them; the kernel is a
      plain non-causal one (cuDNN's on CUDA, which the bottom-right causal mask of the causal backend
      cannot use);
    - the own part: each response's R queries against its own R keys, causal (flash attention), in one
      call for all B rows;
    - the merge: lse = log(e^lse_a + e^lse_b) and out = Σ e^(lse_x − lse)·out_x, which is the softmax
      over the union of the two key sets, the keys a full-sequence causal forward gives a response
      position; one call for all B rows.

    The backward runs each part's backward with the MERGED output and log-sum-exp (P = exp(S − lse) and
    Δ = rowsum(dO ⊙ O) are then those of the whole softmax), so each part's gradients are exact, and
    sums the two query gradients. Kernels: ``cascade_kernels`` (the plain-PyTorch reference off CUDA).
    cuDNN's attention backward does not repeat itself bit for bit, so under
    ``torch.use_deterministic_algorithms`` the boundary part runs flash attention. Opt-in
    (``model.suffix_attention: cascade``): its layer time against causal's, and the GRPO step's, are in
    benchmarks/README.md.

    Each part's output is rounded to the activations' dtype before the merge, and the two query
    gradients are added in it (in bf16 one rounding more than the causal backend;
    tests/numerics/test_gpu_paths.py bounds both backends' errors against float64). In float32 on CUDA the parts run the plain-PyTorch
    kernels, which hold the full score matrices. cuDNN builds one execution plan per new boundary
    length P_g (prompts of many lengths were not measured).

    Args:
        query: [B, H, R, D] (the model's dtype); own_keys/own_values: [B, Hkv, R, D]; B = G·N.
        plan: the boundary KV per layer [G, Hkv, P_max, D] and ``host_prompt_lens`` (G lengths).
        layer: which layer's boundary KV to read.
        scaling: the softmax scale (None: 1/√D).

    Returns:
        [B, R, H, D], the query's dtype.

    Raises:
        ValueError: the plan's G host lengths times N is not B, or bad ``plan.cascade_kernels``.
        RuntimeError: from torch's flash or cuDNN operators on a GPU, dtype or head dim they do not
            take (the causal backend, through SDPA's dispatcher, falls back to another kernel there).
    """
    b, _, _, d = query.shape
    _check_host_lens(plan, b)
    scale = d**-0.5 if scaling is None else float(scaling)
    kernels = cascade_kernels(query.device, query.dtype, plan.cascade_kernels)
    boundary = (plan.prefix_keys[layer], plan.prefix_values[layer])
    out = _CascadeAttention.apply(
        query, own_keys, own_values, *boundary, scale, kernels, tuple(plan.host_prompt_lens)
    )
    return out.transpose(1, 2)


def sdpa_shared_prefix_attention(query, own_keys, own_values, plan: SuffixPlan, layer: int, scaling):
    """Suffix attention as one masked SDPA call per layer: per group, the N suffixes form one query
    sequence of N·R tokens against [boundary KV ; N·R own keys] with ``suffix_bool_mask``. The boundary
    KV is concatenated once per group (never N times); key/value heads are repeated to the query heads
    for the kernels that take an arbitrary mask with a backward (cuDNN's and the memory-efficient
    kernel; SDPA's dispatcher picks among them). About half the scores are masked out; the causal
    backend skips them.

    Args:
        query: [B, H, R, D]; own_keys/own_values: [B, Hkv, R, D].

    Returns:
        [B, R, H, D].
    """
    n, (b, h, r, _) = plan.group_size, query.shape
    keys, values = _group_keys_values(plan, layer, own_keys, own_values)
    rep = h // own_keys.shape[1]
    keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        _fold(query, b // n, n), keys, values, attn_mask=plan.mask, scale=scaling
    )
    return _unfold(out, n, r)


def _group_keys_values(
    plan: SuffixPlan, layer: int, own_keys, own_values
) -> tuple[torch.Tensor, torch.Tensor]:
    """[boundary KV ; the N suffixes' own keys/values] per group: [G, Hkv, P_max + N·R, D] each (the
    boundary is concatenated once per group, never N times)."""
    g, n = own_keys.shape[0] // plan.group_size, plan.group_size
    keys = torch.cat([plan.prefix_keys[layer], _fold(own_keys, g, n)], dim=2)
    values = torch.cat([plan.prefix_values[layer], _fold(own_values, g, n)], dim=2)
    return keys, values


def flex_shared_prefix_attention(query, own_keys, own_values, plan: SuffixPlan, layer: int, scaling):
    """Fused suffix attention with flex_attention: one call per layer for all groups.

    The N suffixes of a group are laid out as one query sequence of N·R tokens against
    [boundary KV ; N·R own keys]; the block mask keeps suffixes apart. The boundary KV is read once
    per group (concatenated once, not N times), and gradients flow into it.

    Args:
        query: [B, H, R, D]; own_keys/own_values: [B, Hkv, R, D].

    Returns:
        [B, R, H, D].
    """
    n, (b, _, r, _) = plan.group_size, query.shape
    keys, values = _group_keys_values(plan, layer, own_keys, own_values)
    out = _flex()(_fold(query, b // n, n), keys, values, block_mask=plan.mask, scale=scaling, enable_gqa=True)
    return _unfold(out, n, r)


# the suffix attention of each backend (SuffixPlan.backend): (query, own keys, own values, plan, layer,
# scaling) -> [B, R, H, D]
SUFFIX_ATTENTION = {
    "dense": shared_prefix_attention,
    "causal": causal_shared_prefix_attention,
    "cascade": cascade_shared_prefix_attention,
    "sdpa": sdpa_shared_prefix_attention,
    "flex": flex_shared_prefix_attention,
}

# "flash" in the name makes transformers' Qwen2.5-VL vision attention pass the packed chunk boundaries
# (cu_seqlens) in one call instead of calling once per chunk (is_flash_attention_requested).
VISION_ATTENTION_NAME = "rollplex_flash_varlen_vision"


def chunked_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask=None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    is_causal: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Non-causal attention within each chunk of a packed sequence — the vision tower's windows and
    frames — as one SDPA call per distinct chunk length instead of one per chunk.

    Args:
        query, key, value: [1, H, S, D], the S tokens of all chunks back to back.
        cu_seq_lens_q: int [C + 1] chunk boundaries (0, e_1, ..., S), the same for keys; None (a
            transformers version that calls once per chunk) treats the input as one chunk.
        scaling: softmax scale; dropout: attention dropout probability (0 for Qwen2.5-VL).

    Returns:
        ([1, S, H, D], None) as transformers' attention functions return. The same arithmetic as
        transformers' per-chunk SDPA loop (tests/models check it in float64, gradients included).

    Raises:
        ValueError: a mask, causal attention, a batch other than 1, key boundaries other than the
            query's, chunk boundaries that do not cover the sequence, or boundaries under another
            keyword name (which would otherwise be read as one chunk).
    """
    _check_chunked_call(query, attention_mask, is_causal, cu_seq_lens_q, cu_seq_lens_k, kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [S, H, D]: token-major, as made
    seq = q.shape[0]
    if cu_seq_lens_q is None:
        return _chunk_sdpa(q, k, v, 1, seq, scaling, dropout)[None], None
    plan = chunk_plan(cu_seq_lens_q, seq, q.device)
    if plan.index is None:  # equal chunks back to back
        length, starts = plan.buckets[0]
        return _chunk_sdpa(q, k, v, len(starts), length, scaling, dropout)[None], None
    out, offset = q.new_empty(q.shape), 0
    for length, starts in plan.buckets:
        rows = plan.index[offset : offset + length * len(starts)]
        chunk = [t.index_select(0, rows) for t in (q, k, v)]
        out.index_copy_(0, rows, _chunk_sdpa(*chunk, len(starts), length, scaling, dropout))
        offset += len(rows)
    return out[None], None


@dataclass(frozen=True)
class ChunkPlan:
    """How ``chunked_attention`` batches a packed sequence of ``seq`` tokens: ``buckets``, (length, chunk
    starts) per distinct non-zero chunk length; ``index``, int64 [seq] on the sequence's device, the
    tokens in bucket order (None when the chunks are equal and back to back, which needs no gather)."""

    seq: int
    buckets: list[tuple[int, list[int]]]
    index: torch.Tensor | None


_PLANS: dict[tuple, tuple[weakref.ref, int, ChunkPlan]] = {}
# plans kept at most, over all streams and threads: two boundary tensors (windows, frames) per video
# grid that models.vision_layout keeps (64 grids, whose tensors stay alive while kept there), or, for
# boundary tensors made per forward, per vision forward whose recompute is still to come (the rollplex
# schedule keeps every group's actor prefix until its backward)
_PLAN_SLOTS = 128
_PLAN_LOCK = threading.Lock()  # the rollplex schedule runs vision towers on two threads


def chunk_plan(bounds: torch.Tensor, seq: int, device: torch.device) -> ChunkPlan:
    """The ``ChunkPlan`` of chunk boundaries ``bounds`` (int [C + 1]) for a sequence on ``device``, made
    once per boundary tensor, device and stream.

    Reading the boundaries makes the host wait for the device, and building the token order takes it
    about a millisecond, during which the device sits idle. transformers hands the same boundary
    tensor to every block of a kind (windowed or full attention), and activation checkpointing's
    recompute hands it over again, so the plan is kept per tensor: a vision forward reads two boundary
    tensors, not one per block. A kept plan is used again only for the same tensor object, unchanged
    as far as its version counter tells (writes that bypass it, through ``.data`` or a NumPy view, are
    not seen), on the device and stream that made it (its token order was copied there). Plans of
    boundary tensors that are gone are dropped at the next new plan. Inference tensors have no
    version counter: their plans are made every call and not kept.

    Raises:
        ValueError: the boundaries do not cover ``seq`` tokens (``_buckets``).
    """
    key = _plan_key(bounds, device)
    keep = not bounds.is_inference()
    kept = _PLANS.get(key) if keep else None
    if kept is not None and kept[0]() is bounds and kept[1] == bounds._version and kept[2].seq == seq:
        with _PLAN_LOCK:  # the most recently used last: the oldest unused plan goes first
            if key in _PLANS:
                _PLANS[key] = _PLANS.pop(key)
        return kept[2]
    plan = _make_plan(bounds.tolist(), seq, device)
    if keep:
        _keep(key, bounds, plan)
    return plan


def keep_plan(bounds: torch.Tensor, host: list[int], device: torch.device) -> None:
    """Make and keep the ``ChunkPlan`` of the boundary tensor ``bounds`` (int [C + 1]) from ``host``, its
    values already on the host, for a sequence of ``host[-1]`` tokens on ``device`` and the current
    stream: ``chunk_plan`` then finds it without reading ``bounds`` back (models.vision_layout). Nothing
    is kept for an inference tensor (``chunk_plan`` makes those every call).

    Raises:
        ValueError: the boundaries do not cover ``host[-1]`` tokens (``_buckets``).
    """
    if not bounds.is_inference():
        _keep(_plan_key(bounds, device), bounds, _make_plan(host, host[-1], device))


def _make_plan(bounds: list[int], seq: int, device: torch.device) -> ChunkPlan:
    """The plan of boundaries ``bounds``; its token order is an ordinary tensor even under inference mode
    (a kept plan serves later passes with gradients)."""
    buckets = _buckets(bounds, seq)
    index = None
    if not (len(buckets) == 1 and len(buckets[0][1]) * buckets[0][0] == seq):
        with torch.inference_mode(False), torch.no_grad():
            host = torch.tensor(
                [i for length, starts in buckets for s in starts for i in range(s, s + length)]
            )
            index = to_device(host, device)
    return ChunkPlan(seq, buckets, index)


def _plan_key(bounds: torch.Tensor, device: torch.device) -> tuple:
    """The key of the plan of ``bounds`` for a sequence on ``device``, on the current stream."""
    return id(bounds), *stream_key(device)


def _keep(key: tuple, bounds: torch.Tensor, plan: ChunkPlan) -> None:
    """Keep ``plan`` under ``key`` (newest last), dropping the plans of boundary tensors that are gone and
    the least recently used beyond ``_PLAN_SLOTS``."""
    with _PLAN_LOCK:
        for dead in [k for k, (ref, _, _) in _PLANS.items() if ref() is None]:
            del _PLANS[dead]  # their boundary tensors are gone: free the token orders
        _PLANS.pop(key, None)
        _PLANS[key] = (weakref.ref(bounds), bounds._version, plan)
        while len(_PLANS) > _PLAN_SLOTS:
            del _PLANS[next(iter(_PLANS))]


def _check_chunked_call(query, attention_mask, is_causal, cu_q, cu_k, kwargs) -> None:
    """The call ``chunked_attention`` is written for (see its Raises)."""
    problems = []
    if attention_mask is not None or is_causal or query.shape[0] != 1:
        problems.append("no mask, non-causal, batch 1")
    if cu_k is not None and cu_k is not cu_q and (cu_q is None or not torch.equal(cu_k, cu_q)):
        problems.append("key chunk boundaries equal to the query's")
    if cu_q is None and any(name.startswith("cu_seq") for name in kwargs):
        problems.append(f"boundaries as cu_seq_lens_q (got {sorted(kwargs)})")
    if problems:
        raise ValueError("chunked vision attention needs " + "; ".join(problems))


def _buckets(bounds: list[int], seq: int) -> list[tuple[int, list[int]]]:
    """(length, chunk starts) per distinct non-zero chunk length, from boundaries (0, ..., seq)."""
    if not bounds or bounds[0] != 0 or bounds[-1] != seq or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"chunk boundaries {bounds[:4]}...{bounds[-2:]} do not cover {seq} tokens")
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    return list(by_length.items())


def _chunk_sdpa(q, k, v, chunks: int, length: int, scaling: float | None, dropout: float) -> torch.Tensor:
    """Token-major [chunks·length, H, D] inputs, chunk after chunk → non-causal SDPA within each chunk,
    same layout out."""
    heads, dim = q.shape[1:]
    split = [t.view(chunks, length, heads, dim).transpose(1, 2) for t in (q, k, v)]  # [C, H, L, D]
    out = F.scaled_dot_product_attention(*split, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).reshape(chunks * length, heads, dim)


# opaque to torch.compile (see register)
_OPAQUE_TEXT = torch.compiler.disable(rollplex_attention)
_OPAQUE_VISION = torch.compiler.disable(chunked_attention)


def register() -> None:
    """Register :func:`rollplex_attention` under ``ATTENTION_NAME`` and :func:`chunked_attention` under
    ``VISION_ATTENTION_NAME`` (idempotent). Both are opaque to torch.compile (a graph break around each
    call when the attention modules run compiled, models.compiled): their plans hold Python state and
    the chunk plans read boundaries back to the host."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _OPAQUE_TEXT)
    AttentionInterface.register(VISION_ATTENTION_NAME, _OPAQUE_VISION)

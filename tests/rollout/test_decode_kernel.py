"""The fused Triton decode attention equals the dense decode attention (float32; on the CPU through
Triton's interpreter, which tests/conftest.py switches on), including padded prompts, several prefix
chunks, empty chunks and unwritten cache slots."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollplex.rollout.decode import DecodeShape, decode_attention, rope_tables, rotate  # noqa: E402
from rollplex.rollout.decode_kernel import PREFIX_CHUNK, fused_decode_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5 if DEVICE == "cpu" else 5e-3  # float32 products run as TF32 on the GPU's tensor cores


def _case(
    seed: int, groups=2, n=3, hkv=2, rep=4, d=16, p=PREFIX_CHUNK + 44, window=70, step=40, lens=(300, 137)
):
    g = torch.Generator().manual_seed(seed)
    b, h = groups * n, hkv * rep
    q = torch.randn(b, h, d, generator=g)
    pk, pv = torch.randn(groups, hkv, p, d, generator=g), torch.randn(groups, hkv, p, d, generator=g)
    lens = torch.tensor(lens, dtype=torch.int32)
    for i, length in enumerate(lens.tolist()):
        pk[i, :, length:] = pv[i, :, length:] = 0.0  # padding is zeros, as merge_prefixes pads
    cache_k, cache_v = torch.randn(b, hkv, 1024, d, generator=g), torch.randn(b, hkv, 1024, d, generator=g)
    cache_k[:, :, step + 1 :] = float("nan")  # unwritten slots must never be read
    cache_v[:, :, step + 1 :] = float("nan")
    shape = DecodeShape(groups, n, h, hkv, d, 1024, d**-0.5, 1e-6)
    q, pk, pv, lens, cache_k, cache_v = (t.to(DEVICE) for t in (q, pk, pv, lens, cache_k, cache_v))
    return q, pk, pv, lens, cache_k[:, :, :window], cache_v[:, :, :window], step, shape


def _dense(q, pk, pv, lens, own_k, own_v, step, shape):
    """The dense decode attention with the additive bias StaticDecoder builds (padding and future own
    slots at -inf; the dense path multiplies every slot, so unwritten ones are zeroed here)."""
    n, p, window = shape.group_size, pk.shape[2], own_k.shape[2]
    hidden = torch.cat(
        [
            (torch.arange(p, device=DEVICE)[None, :] >= lens[:, None]).repeat_interleave(n, 0),
            (torch.arange(window, device=DEVICE)[None, :] > step).expand(q.shape[0], -1),
        ],
        dim=1,
    )
    bias = torch.zeros(hidden.shape, device=DEVICE).masked_fill(hidden, float("-inf"))[:, None, None, :]
    return decode_attention(q, pk, pv, torch.nan_to_num(own_k), torch.nan_to_num(own_v), bias, shape)


def _fused(q, pk, pv, lens, own_k, own_v, step, scaling, n, **knobs):
    """The kernel as the decoder calls it: the step's key/value passed in and written by the kernel; the
    slot holds NaN before, so reading it unwritten fails. Returns the output and checks the slot."""
    new_k, new_v = own_k[:, :, step].clone(), own_v[:, :, step].clone()
    own_k[:, :, step] = own_v[:, :, step] = float("nan")
    step_t = torch.tensor([step], device=DEVICE)
    out = fused_decode_attention(q, pk, pv, lens, own_k, own_v, new_k, new_v, step_t, scaling, n, **knobs)
    assert torch.equal(own_k[:, :, step], new_k) and torch.equal(own_v[:, :, step], new_v)
    return out


@pytest.mark.parametrize(
    ("seed", "window", "step"),
    [(0, 70, 40), (1, 70, 69), (2, 300, 40), (3, 300, 200), (4, 700, 600), (5, 1000, 300)],
)
def test_fused_equals_dense(seed, window, step):
    """One or two own-key chunks of the default 512 keys (windows 700 and 1000: the second chunk holds
    the step, or lies past it), as in test_tuning_knobs_change_no_result for other sizes; the step's
    key/value written into the cache by the kernel."""
    q, pk, pv, lens, own_k, own_v, step, shape = _case(seed, window=window, step=step)
    dense = _dense(q, pk, pv, lens, own_k, own_v, step, shape)
    fused = _fused(q, pk, pv, lens, own_k, own_v, step, shape.scaling, shape.group_size)
    assert torch.isfinite(fused).all()
    assert (fused - dense).abs().max() <= TOL


def test_windows_inside_one_own_key_chunk_give_the_same_bits():
    """The decoder captures one graph per own-key chunk of windows (rollout.decode.graph_window): any
    window inside one chunk launches the same programs, which read no key past the step, so the output
    is bitwise the same for windows of 48, 300 and 512 keys at step 40; a window of two chunks (600)
    launches more programs and still equals the dense result."""
    q, pk, pv, lens, own_k, own_v, step, shape = _case(6, window=1024, step=40)
    outs = [
        _fused(q, pk, pv, lens, own_k[:, :, :w], own_v[:, :, :w], step, shape.scaling, shape.group_size)
        for w in (48, 300, 512, 600)
    ]
    assert all(torch.equal(outs[0], out) for out in outs[1:3])
    dense = _dense(q, pk, pv, lens, own_k[:, :, :48], own_v[:, :, :48], step, shape)
    assert (outs[3] - dense).abs().max() <= TOL


@pytest.mark.parametrize(
    "knobs",
    [
        {"prefix_chunk": 128, "own_chunk": 64},
        {"prefix_chunk": 1024, "own_chunk": 128},
        {"own_chunk": 256},
        {"prefix_chunk": 77, "own_chunk": 100},  # sizes that are not multiples of the 64-key blocks
    ],
)
def test_tuning_knobs_change_no_result(knobs):
    """Other chunk sizes (more or fewer partials per query, several own-key chunks, some past the
    step) give the dense result too."""
    q, pk, pv, lens, own_k, own_v, step, shape = _case(5, window=300, step=200)
    dense = _dense(q, pk, pv, lens, own_k, own_v, step, shape)
    fused = _fused(q, pk, pv, lens, own_k, own_v, step, shape.scaling, shape.group_size, **knobs)
    assert (fused - dense).abs().max() <= TOL


def test_step_zero_and_group_of_one_with_odd_heads():
    """Only own key 0 visible; N = 1 and rep = 3 (query blocks padded to 16)."""
    q, pk, pv, lens, own_k, own_v, step, shape = _case(2, groups=2, n=1, hkv=1, rep=3, step=0, lens=(300, 1))
    dense = _dense(q, pk, pv, lens, own_k, own_v, step, shape)
    assert (_fused(q, pk, pv, lens, own_k, own_v, 0, shape.scaling, 1) - dense).abs().max() <= TOL


def _rope(rows: int, d: int, dtype):
    """cos, sin [rows, D] of positions far past the prompt (rows apart), as the decoder builds them."""
    positions = torch.arange(rows, device=DEVICE) * 37 + 4000
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, d, 2, device=DEVICE, dtype=torch.float32) / d)
    return rope_tables(positions, inv_freq, 1.0, dtype)


@pytest.mark.parametrize(("seed", "window", "step"), [(7, 300, 200), (8, 700, 600), (9, 70, 0)])
def test_rope_in_the_kernel_equals_rotating_first(seed, window, step):
    """Given cos/sin, the kernel takes q and the step's key before RoPE: the output equals the dense
    attention of the rotated query over a cache holding the rotated key, and the cache slot gets the key
    as ``rotate`` computes it."""
    q, pk, pv, lens, own_k, own_v, step, shape = _case(seed, window=window, step=step)
    cos, sin = _rope(q.shape[0], q.shape[2], q.dtype)
    new_k, new_v = own_k[:, :, step].clone(), own_v[:, :, step].clone()
    rotated_k = rotate(new_k, cos, sin)
    reference_k = own_k.clone()
    reference_k[:, :, step] = rotated_k
    dense = _dense(rotate(q, cos, sin), pk, pv, lens, reference_k, own_v, step, shape)
    own_k[:, :, step] = own_v[:, :, step] = float("nan")
    step_t = torch.tensor([step], device=DEVICE)
    fused = fused_decode_attention(
        q, pk, pv, lens, own_k, own_v, new_k, new_v, step_t, shape.scaling, shape.group_size, cos=cos, sin=sin
    )
    assert (fused - dense).abs().max() <= TOL
    assert (own_k[:, :, step] - rotated_k).abs().max() <= TOL and torch.equal(own_v[:, :, step], new_v)
    assert (fused - _dense(q, pk, pv, lens, reference_k, own_v, step, shape)).abs().max() > 10 * TOL


@pytest.mark.skipif(DEVICE == "cuda", reason="checked in Triton's interpreter only (not yet run on CUDA)")
def test_rope_in_the_kernel_float64():
    """A float64 model's RoPE stays in float64 inside the kernel: the key written into the cache equals
    ``rotate``'s within float64 rounding (the softmax statistics are float32 in every dtype, so the
    output is held to the float32 bound)."""
    q, pk, pv, lens, own_k, own_v, step, shape = (
        t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in _case(11, window=300, step=200)
    )
    cos, sin = _rope(q.shape[0], q.shape[2], torch.float64)
    new_k, new_v = own_k[:, :, step].clone(), own_v[:, :, step].clone()
    reference_k = own_k.clone()
    reference_k[:, :, step] = rotate(new_k, cos, sin)
    dense = _dense(rotate(q, cos, sin), pk, pv, lens, reference_k, own_v, step, shape)
    step_t = torch.tensor([step], device=DEVICE)
    fused = fused_decode_attention(
        q, pk, pv, lens, own_k, own_v, new_k, new_v, step_t, shape.scaling, shape.group_size, cos=cos, sin=sin
    )
    assert fused.dtype == torch.float64 and (fused - dense).abs().max() <= TOL
    assert (own_k[:, :, step] - reference_k[:, :, step]).abs().max() <= 1e-14


def test_rope_tables_must_match_q():
    q, pk, pv, lens, own_k, own_v, step, shape = _case(6)
    cos, sin = _rope(q.shape[0], q.shape[2], q.dtype)
    new = (own_k[:, :, step].clone(), own_v[:, :, step].clone())
    step_t = torch.tensor([step], device=DEVICE)
    wide_sin = torch.cat([sin, sin], dim=1)[:, : sin.shape[1]]  # same values, rows twice as far apart
    for tables in (
        {"cos": cos},
        {"cos": cos, "sin": sin[:1]},
        {"cos": cos, "sin": sin.double()},
        {"cos": cos, "sin": wide_sin},
    ):
        with pytest.raises(ValueError, match="cos and sin"):
            fused_decode_attention(q, pk, pv, lens, own_k, own_v, *new, step_t, shape.scaling, 3, **tables)


@pytest.mark.parametrize(
    "knobs",
    [
        {"block_keys": 32, "num_warps": 8, "num_stages": 2},
        {"block_keys": 128, "num_stages": 1},
        {"merge_warps": 4},
    ],
)
def test_launch_knobs_change_no_result(knobs):
    """Other key blocks, warps and pipeline stages give the dense result too (Triton's interpreter
    ignores warps and stages: on the CPU this checks the key blocks; the GPU run checks all)."""
    q, pk, pv, lens, own_k, own_v, step, shape = _case(10, window=300, step=200)
    dense = _dense(q, pk, pv, lens, own_k, own_v, step, shape)
    fused = _fused(q, pk, pv, lens, own_k, own_v, step, shape.scaling, shape.group_size, **knobs)
    assert (fused - dense).abs().max() <= TOL


@pytest.mark.parametrize(
    "knobs",
    [{"block_keys": 48}, {"block_keys": 8}, {"num_warps": 0}, {"num_warps": 3}, {"merge_warps": 0}],
)
def test_launch_knobs_are_checked(knobs):
    q, pk, pv, lens, own_k, own_v, step, shape = _case(6)
    with pytest.raises(ValueError, match="block_keys|warps"):
        _fused(q, pk, pv, lens, own_k, own_v, step, shape.scaling, 3, **knobs)


@pytest.mark.parametrize("knobs", [{"own_chunk": 0}, {"prefix_chunk": -64}, {"own_chunk": 512.0}])
def test_chunk_sizes_must_be_positive_integers(knobs):
    q, pk, pv, lens, own_k, own_v, step, shape = _case(6)
    with pytest.raises(ValueError, match="chunk sizes"):
        _fused(q, pk, pv, lens, own_k, own_v, step, shape.scaling, 3, **knobs)


def test_bad_head_dim_is_named():
    q, pk, pv, lens, own_k, own_v, step, shape = _case(3, d=24)
    with pytest.raises(ValueError, match="power of two"):
        _fused(q, pk, pv, lens, own_k, own_v, step, shape.scaling, 3)


def test_wrong_inputs_are_named():
    q, pk, pv, lens, own_k, own_v, step, shape = _case(4)
    step_t = torch.tensor([step], device=DEVICE)
    new = (own_k[:, :, step].clone(), own_v[:, :, step].clone())
    with pytest.raises(ValueError, match="prefix_lens int32"):
        fused_decode_attention(q, pk, pv, lens.long(), own_k, own_v, *new, step_t, shape.scaling, 3)
    with pytest.raises(ValueError, match="B = G·N"):
        fused_decode_attention(q, pk, pv, lens, own_k, own_v, *new, step_t, shape.scaling, 2)
    with pytest.raises(ValueError, match="step's key/value of shape"):
        fused_decode_attention(q, pk, pv, lens, own_k, own_v, new[0][:1], new[1], step_t, shape.scaling, 3)
    with pytest.raises(ValueError, match="cache's dtype"):
        fused_decode_attention(
            q, pk, pv, lens, own_k, own_v, new[0].double(), new[1], step_t, shape.scaling, 3
        )
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous last"):
        fused_decode_attention(q_strided, pk, pv, lens, own_k, own_v, *new, step_t, shape.scaling, 3)


def _inputs_3b(step: int = 300):
    """bf16 CUDA inputs at the 3B workload's shape: 8 groups of 8, 2 kv heads of 8 queries, D = 128,
    P = 3920 (8 prefix chunks, ragged prompt lengths, one of a single token), a 512-key window."""
    g, n, hkv, rep, d, p, window = 8, 8, 2, 8, 128, 3920, 512
    lens = (3920, 3900, 3000, 3920, 2500, 3920, 3919, 1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    q, pk, pv = rand(g * n, hkv * rep, d), rand(g, hkv, p, d), rand(g, hkv, p, d)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for i, length in enumerate(lens):
        pk[i, :, length:] = pv[i, :, length:] = 0
    own_k, own_v = rand(g * n, hkv, window, d), rand(g * n, hkv, window, d)
    shape = DecodeShape(g, n, hkv * rep, hkv, d, window, d**-0.5, 1e-6)
    return q, pk, pv, lens_t, own_k, own_v, step, shape


def _float64_reference(q, pk, pv, lens_t, own_k, own_v, step, shape) -> torch.Tensor:
    """The dense decode attention in float64 of the given inputs (own slots after the step hidden)."""
    p, window, rows = pk.shape[2], own_k.shape[2], q.shape[0]
    hidden = torch.cat(
        [
            (torch.arange(p, device="cuda")[None, :] >= lens_t[:, None]).repeat_interleave(
                shape.group_size, 0
            ),
            (torch.arange(window, device="cuda")[None, :] > step).expand(rows, -1),
        ],
        dim=1,
    )
    bias = torch.zeros(hidden.shape, device="cuda", dtype=torch.float64).masked_fill(hidden, float("-inf"))
    return decode_attention(*(t.double() for t in (q, pk, pv, own_k, own_v)), bias[:, None, None, :], shape)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_at_the_3b_shape_against_float64():
    """The GPU configuration against a float64 dense reference of the same bf16 inputs: ≤ 2e-2 max abs
    (bf16 inputs, float32 softmax, bf16 probabilities in the value product)."""
    q, pk, pv, lens_t, own_k, own_v, step, shape = _inputs_3b()
    fused = _fused(q, pk, pv, lens_t, own_k, own_v, step, shape.scaling, shape.group_size)
    err = (fused.double() - _float64_reference(q, pk, pv, lens_t, own_k, own_v, step, shape)).abs().max()
    print(f"fused bf16 vs float64 dense: max abs {float(err):.3g}")
    assert err <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_rope_at_the_3b_shape_against_float64():
    """RoPE in the kernel, in bf16 at the 3B shape, against a float64 reference that rotates q and the
    step's key in float64 (same bound as above; the kernel rounds the rotated values to bf16)."""
    q, pk, pv, lens_t, own_k, own_v, step, shape = _inputs_3b()
    cos, sin = _rope(q.shape[0], q.shape[2], q.dtype)
    new_k, new_v = own_k[:, :, step].clone(), own_v[:, :, step].clone()
    reference_k = own_k.double()
    reference_k[:, :, step] = rotate(new_k.double(), cos.double(), sin.double())
    step_t = torch.tensor([step], device="cuda")
    fused = fused_decode_attention(
        q,
        pk,
        pv,
        lens_t,
        own_k,
        own_v,
        new_k,
        new_v,
        step_t,
        shape.scaling,
        shape.group_size,
        cos=cos,
        sin=sin,
    )
    rotated_q = rotate(q.double(), cos.double(), sin.double())
    ref = _float64_reference(rotated_q, pk, pv, lens_t, reference_k, own_v, step, shape)
    err = (fused.double() - ref).abs().max()
    print(f"fused bf16 with RoPE vs float64 dense: max abs {float(err):.3g}")
    assert err <= 2e-2
    assert (own_k[:, :, step].double() - reference_k[:, :, step]).abs().max() <= 2e-2

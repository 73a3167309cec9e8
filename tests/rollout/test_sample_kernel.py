"""The fused sampling race (rollout.sample_kernel) against rollout.sampler.race_tokens on the same noise:
the same tokens, log-probs equal up to float32 summation order (on the CPU through Triton's
interpreter, which tests/conftest.py switches on; on CUDA when present)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollplex.rollout import sample_kernel  # noqa: E402
from rollplex.rollout.sample_kernel import BLOCK, MAX_VOCAB, SPLITS, fused_race  # noqa: E402
from rollplex.rollout.sampler import race_tokens  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(rows, vocab, dtype, seed, spread=4.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * spread).to(dtype)
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    return logits.to(DEVICE), noise.to(DEVICE)


@pytest.mark.parametrize(
    ("rows", "vocab", "dtype", "temperature"),
    [
        (5, 300, torch.float32, 1.0),  # two slices of 150 in one block each
        (3, SPLITS * 1024 + 77, torch.float32, 0.7),  # several blocks per slice, a ragged last slice
        (4, 5000, torch.bfloat16, 1.3),
        (2, 1, torch.float32, 1.0),  # one id
        (3, 15, torch.float32, 1.0),  # fewer ids than a block's minimum
        (3, 2048, torch.float32, 0.9),  # a whole number of blocks
    ],
)
def test_fused_race_equals_the_eager_race(rows, vocab, dtype, temperature):
    logits, noise = _inputs(rows, vocab, dtype, seed=vocab)
    banned_ids = sorted({i for i in (1, 7, vocab - 1) if 0 < i < vocab})  # none for a one-id vocabulary
    banned = torch.tensor(banned_ids, dtype=torch.long, device=DEVICE)
    args = dict(temperature=temperature, banned_ids=banned)
    tokens, logprobs = fused_race(logits, noise, **args)
    want_tokens, want_logprobs = race_tokens(logits, noise, **args)
    assert torch.equal(tokens, want_tokens)
    assert logprobs.dtype == torch.float32
    assert (logprobs - want_logprobs).abs().max() <= 2e-5


def test_banned_ids_lose_even_when_most_likely():
    logits, noise = _inputs(6, 400, torch.float32, seed=1)
    logits[:, 13] = 1e4  # would win every race
    tokens, _ = fused_race(logits, noise, temperature=1.0, banned_ids=torch.tensor([13], device=DEVICE))
    assert not (tokens == 13).any()
    want, _ = race_tokens(logits, noise, temperature=1.0, banned_ids=torch.tensor([13], device=DEVICE))
    assert torch.equal(tokens, want)


def test_ties_go_to_the_first_index_as_argmax():
    """Equal scores in different slices and lanes: the smallest vocabulary id wins, as ``argmax``."""
    logits = torch.zeros(2, 3000, device=DEVICE)
    noise = torch.ones(2, 3000, device=DEVICE)
    for v in (2999, 1500, 700):
        logits[:, v] = 5.0
    tokens, logprobs = fused_race(
        logits, noise, temperature=1.0, banned_ids=torch.tensor([], device=DEVICE, dtype=torch.long)
    )
    assert tokens.tolist() == [700, 700]
    want = torch.log_softmax(logits, dim=-1)[:, 700]
    assert (logprobs - want).abs().max() <= 1e-5


@pytest.mark.parametrize(("top_p", "top_k", "greedy"), [(0.9, 0, False), (1.0, 5, False), (1.0, 0, True)])
def test_filters_and_greedy_take_the_eager_race(top_p, top_k, greedy):
    logits, noise = _inputs(3, 200, torch.float32, seed=2)
    args = dict(
        temperature=0.0 if greedy else 1.0,
        banned_ids=torch.tensor([3], device=DEVICE),
        top_p=top_p,
        top_k=top_k,
    )
    noise = None if greedy else noise
    got, want = fused_race(logits, noise, **args), race_tokens(logits, noise, **args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN arithmetic, on purpose
def test_a_row_without_a_finite_score_gives_an_id_in_range():
    """A NaN row (every score NaN) must not send the out-of-range sentinel index to the gather or the
    next step's embedding lookup."""
    logits, noise = _inputs(2, 3000, torch.float32, seed=3)
    logits[1] = float("nan")
    tokens, _ = fused_race(logits, noise, temperature=1.0, banned_ids=torch.tensor([5], device=DEVICE))
    assert 0 <= int(tokens[1]) < 3000
    assert int(tokens[0]) == int(
        race_tokens(logits[:1], noise[:1], temperature=1.0, banned_ids=torch.tensor([5], device=DEVICE))[0]
    )


def test_ties_within_one_lane_and_program_go_to_the_first_index():
    """Equal best scores in one program: in the same lane across blocks (ids 6 and BLOCK + 6) and in two
    lanes of one block (BLOCK + 5): the smallest id wins, as ``argmax``."""
    vocab = SPLITS * BLOCK * 2  # two blocks per slice
    logits = torch.zeros(2, vocab, device=DEVICE)
    noise = torch.ones(2, vocab, device=DEVICE)
    for v in (BLOCK + 6, 6, BLOCK + 5):
        logits[:, v] = 5.0
    none = torch.tensor([], device=DEVICE, dtype=torch.long)
    tokens, _ = fused_race(logits, noise, temperature=1.0, banned_ids=none)
    assert tokens.tolist() == [6, 6]


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_slices_without_a_finite_logit_merge_away(temperature):
    """The first slices hold only -inf logits (their running max stays -inf): the token and its
    log-prob still equal the eager race's, and the log-prob is finite."""
    logits, noise = _inputs(3, 5000, torch.float32, seed=4)
    logits[:, : 3 * BLOCK] = float("-inf")
    args = dict(temperature=temperature, banned_ids=torch.tensor([4000], device=DEVICE))
    (tokens, logprobs), (want_tokens, want_logprobs) = (
        fused_race(logits, noise, **args),
        race_tokens(logits, noise, **args),
    )
    assert torch.equal(tokens, want_tokens) and bool(torch.isfinite(logprobs).all())
    assert (logprobs - want_logprobs).abs().max() <= 2e-5


def test_the_vocabulary_bound_leaves_room_in_int32():
    """The kernel forms ids up to a slice's end (≤ V + SPLITS) and a block past it (+ BLOCK) in int32,
    and keeps 2³¹ − 1 as its no-index sentinel."""
    assert MAX_VOCAB + SPLITS + BLOCK < 2**31 - 1


def test_a_vocabulary_over_the_bound_takes_the_eager_race(monkeypatch):
    """At the bound the kernel runs; one id over it, the eager race (a bound of 300 stands in for 2³⁰)."""
    seen = []
    monkeypatch.setattr(sample_kernel, "MAX_VOCAB", 300)
    monkeypatch.setattr(
        sample_kernel, "race_tokens", lambda logits, *a, **k: seen.append(logits.shape) or (None, None)
    )
    none = torch.tensor([], dtype=torch.long, device=DEVICE)
    logits, noise = _inputs(2, 301, torch.float32, seed=5)
    tokens, _ = fused_race(logits[:, :300], noise[:, :300].contiguous(), temperature=1.0, banned_ids=none)
    assert seen == [] and tokens.shape == (2,)
    fused_race(logits, noise, temperature=1.0, banned_ids=none)
    assert seen == [(2, 301)]

"""Sampler definitions: field cases B05 (banned vision ids) and B08 (one log-prob definition)."""

import math

import pytest
import torch

from rollplex.rollout.sampler import entropy, masked_logits, sample_tokens, support_mask, token_logprobs

B08_LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
NO_BAN = torch.zeros(0, dtype=torch.int64)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_b08_trainer_logprob_definition():
    lp = token_logprobs(B08_LOGITS, 0.6, NO_BAN)
    assert lp.dtype == torch.float32
    assert lp[0, 0].item() == pytest.approx(-0.2081, abs=1e-4)
    assert lp[0, 1].item() == pytest.approx(-1.8747, abs=1e-4)
    # Independent closed form: log_softmax(x / T)_i = x_i / T - log sum_j exp(x_j / T).
    x = [2.0, 1.0, 0.0, -1.0]
    log_z = math.log(sum(math.exp(v / 0.6) for v in x))
    assert lp[0].tolist() == pytest.approx([v / 0.6 - log_z for v in x], abs=1e-6)
    # The two wrong definitions of the case are far from it.
    assert lp[0, 0].item() != pytest.approx(-0.4402, abs=1e-3)
    assert lp[0, 0].item() != pytest.approx(-0.7336, abs=1e-3)


def test_b08_top_p_kept_set_and_mass():
    lp = token_logprobs(B08_LOGITS, 0.6, NO_BAN)
    keep = support_mask(lp, top_p=0.9)
    assert keep[0].tolist() == [True, True, False, False]
    assert lp[0].exp()[keep[0]].sum().item() == pytest.approx(0.96555, abs=1e-5)


def test_b08_recorded_logprob_is_not_renormalised():
    logits = B08_LOGITS.expand(512, 4)
    tokens, recorded = sample_tokens(
        logits, temperature=0.6, top_p=0.9, banned_ids=NO_BAN, generator=_seeded(0)
    )
    assert set(tokens.tolist()) == {0, 1}
    row0 = tokens == 0
    assert torch.allclose(recorded[row0], torch.tensor(-0.2081), atol=1e-4)
    assert not torch.allclose(recorded[row0], torch.tensor(-0.1730), atol=1e-3)
    # Step 0: the trainer recomputes log-probs with the same definition; ratio is exactly 1.
    rescored = token_logprobs(logits, 0.6, NO_BAN).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.equal(torch.exp(rescored - recorded), torch.ones(512))


def test_sampled_frequencies_match_renormalised_kept_distribution():
    logits = torch.tensor([[1.5, 1.0, 0.5, 0.0, -3.0]]).expand(40_000, 5)
    tokens, _ = sample_tokens(logits, temperature=1.0, top_k=3, banned_ids=NO_BAN, generator=_seeded(1))
    probs = torch.softmax(torch.tensor([1.5, 1.0, 0.5]), dim=0)
    freq = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    assert freq[3:].tolist() == [0.0, 0.0]
    assert torch.allclose(freq[:3], probs, atol=0.01)  # 4 sigma at n = 40k


def test_top_k_ties_at_boundary_are_kept():
    lp = torch.log_softmax(torch.tensor([[3.0, 1.0, 1.0, 0.0]]), dim=-1)
    assert support_mask(lp, top_k=2)[0].tolist() == [True, True, True, False]
    assert support_mask(lp, top_k=1)[0].tolist() == [True, False, False, False]
    assert support_mask(lp, top_k=10)[0].tolist() == [True, True, True, True]


def test_top_p_applies_after_top_k_on_renormalised_mass():
    # Probs 0.45, 0.27, 0.18, 0.10. Without top_k the mass before token 1 is 0.45 < 0.6 (kept) and
    # before token 2 is 0.72 (dropped). After top_k=2 the pair renormalises to 0.625 / 0.375, so the
    # mass before token 1 is 0.625 >= 0.6 and only token 0 is kept.
    lp = torch.log(torch.tensor([[0.45, 0.27, 0.18, 0.10]]))
    assert support_mask(lp, top_p=0.6)[0].tolist() == [True, True, False, False]
    assert support_mask(lp, top_p=0.6, top_k=2)[0].tolist() == [True, False, False, False]


def test_banned_ids_never_sampled_even_when_most_likely():
    banned = torch.tensor([1, 3], dtype=torch.int64)
    logits = torch.tensor([[0.0, 9.0, 0.5, 9.0, 0.2]]).expand(20_000, 5)
    tokens, recorded = sample_tokens(logits, temperature=1.3, banned_ids=banned, generator=_seeded(2))
    assert not torch.isin(tokens, banned).any()
    assert set(tokens.tolist()) == {0, 2, 4}
    assert torch.isfinite(recorded).all()
    greedy, _ = sample_tokens(logits[:1], temperature=0.0, banned_ids=banned)
    assert greedy.tolist() == [2]


def test_masked_logits_sets_minus_inf_and_blocks_gradient():
    logits = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    out = masked_logits(logits, torch.tensor([2], dtype=torch.int64))
    assert out[0].tolist() == [1.0, 2.0, float("-inf")]
    assert logits[0, 2].item() == 3.0  # input untouched
    torch.log_softmax(out, -1)[0, 0].backward()
    assert logits.grad[0, 2].item() == 0.0
    with pytest.raises(ValueError, match="banned_ids"):
        masked_logits(logits, torch.tensor([2], dtype=torch.int32))


def test_greedy_picks_argmax_and_records_temperature_one():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 2.9, 0.0]])
    tokens, recorded = sample_tokens(logits, temperature=0.0, top_p=0.5, top_k=1, banned_ids=NO_BAN)
    assert tokens.tolist() == [1, 0]
    expected = torch.log_softmax(logits, -1)[torch.arange(2), tokens]
    assert torch.equal(recorded, expected)


def test_seeded_generator_is_deterministic():
    logits = torch.randn(64, 50, generator=_seeded(3))
    a, la = sample_tokens(logits, temperature=1.0, top_p=0.95, banned_ids=NO_BAN, generator=_seeded(7))
    b, lb = sample_tokens(logits, temperature=1.0, top_p=0.95, banned_ids=NO_BAN, generator=_seeded(7))
    c, _ = sample_tokens(logits, temperature=1.0, top_p=0.95, banned_ids=NO_BAN, generator=_seeded(8))
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert not torch.equal(a, c)
    assert a.dtype == torch.int64 and la.dtype == torch.float32


def test_bfloat16_logits_give_float32_logprobs():
    logits = B08_LOGITS.to(torch.bfloat16)
    lp = token_logprobs(logits, 0.6, NO_BAN)
    assert lp.dtype == torch.float32
    assert lp[0, 0].item() == pytest.approx(-0.2081, abs=1e-4)  # these logits are exact in bf16


def test_entropy_against_closed_form_and_banned_entries():
    p = torch.tensor([0.5, 0.25, 0.25])
    assert entropy(p.log()).item() == pytest.approx(1.5 * math.log(2), abs=1e-6)
    lp = token_logprobs(torch.tensor([[0.0, 0.0, 5.0]], requires_grad=True), 1.0, torch.tensor([2]))
    ent = entropy(lp)
    assert ent.item() == pytest.approx(math.log(2), abs=1e-6)
    logits = torch.tensor([[0.3, -0.2, 5.0]], requires_grad=True)
    entropy(token_logprobs(logits, 1.0, torch.tensor([2]))).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2].item() == 0.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
    ],
)
def test_bad_settings_raise(kwargs, field):
    with pytest.raises(ValueError, match=field):
        sample_tokens(B08_LOGITS, banned_ids=NO_BAN, **kwargs)


def test_logprobs_need_positive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(B08_LOGITS, 0.0, NO_BAN)

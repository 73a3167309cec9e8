"""The sampler: field cases B05 (banned vision ids never drawn) and B08 (recorded log-probs not renormalised)."""

import pytest
import torch

from rollplex.models.logprobs import token_logprobs
from rollplex.rollout.sampler import sample_tokens, support_mask

B08_LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
NO_BAN = torch.zeros(0, dtype=torch.int64)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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

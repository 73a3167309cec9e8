"""B11 in the training code: ``phases.actor_backward`` with one group per micro-batch accumulates the
same gradient as the whole mini-batch in one pass, for every loss aggregation, when the groups' responses
have different lengths (each micro-batch's loss is normalised by the mini-batch's counts, not its own)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollplex.config import load_config
from rollplex.data.synth import generate_dataset
from rollplex.loop import build_run
from rollplex.models.presets import init_checkpoint
from rollplex.phases import actor_backward, reference_phase, reward_phase, rollout_phase


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """A float64 run of the tiny model, one rollout of 3 groups of 2, its scores, and responses cut to
    lengths 1..4 so the groups hold 3, 7 and 8 response tokens."""
    root = tmp_path_factory.mktemp("micro")
    model = init_checkpoint("tiny", root / "model", seed=0)
    generate_dataset(root / "data", 8, 0, width=56, height=56, num_frames=8, fps=4.0, families=("color",))
    overrides = {
        "run.out_dir": str(root / "run"),
        "run.device": "cpu",  # float64 rollout: the CPU path on any machine
        "run.dtype": "float64",
        "model.path": str(model),
        "data.train_path": str(root / "data" / "train.json"),
        "data.template": "answer_only",
        "data.video_min_pixels": 3136,
        "data.video_max_pixels": 3136,
        "rollout.group_size": 2,
        "rollout.prompts_per_step": 3,
        "rollout.max_response_tokens": 4,
        "reward.functions": "[answer_accuracy, answer_format]",
        "algo.kl_coef": 0.04,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    run = build_run(cfg)
    roles = run.roles
    rollout = rollout_phase(roles, run.train.next_batch(), 2, roles.sampling)
    rollout = dataclasses.replace(rollout, response_lens=torch.tensor([1, 2, 3, 4, 4, 4]))
    scored = reference_phase(roles, reward_phase(roles, rollout))
    advantages = torch.tensor([0.7, -0.3, 1.1, -0.9, 0.4, -0.2])  # nonzero for every row
    return roles, dataclasses.replace(scored, advantages=advantages)


def _gradients(roles, scored, aggregation: str, micro: int) -> dict[str, torch.Tensor]:
    algo = dataclasses.replace(roles.config.algo, loss_agg=aggregation, micro_batch_groups=micro)
    roles = dataclasses.replace(roles, config=dataclasses.replace(roles.config, algo=algo))
    roles.optimizer.zero_grad()
    actor_backward(roles, scored, [0, 1, 2], None)
    grads = {n: p.grad.clone() for n, p in roles.actor.named_parameters() if p.grad is not None}
    roles.optimizer.zero_grad()
    return grads


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_one_group_per_micro_batch_accumulates_the_whole_batch_gradient(batch, aggregation):
    roles, scored = batch
    assert scored.rollout.response_mask().view(3, -1).sum(1).tolist() == [3, 7, 8]
    whole = _gradients(roles, scored, aggregation, 0)
    split = _gradients(roles, scored, aggregation, 1)
    assert whole.keys() == split.keys() and len(whole) > 10
    scale = max(float(g.abs().max()) for g in whole.values())
    assert scale > 0
    assert all(torch.allclose(split[n], whole[n], rtol=0, atol=1e-12 * scale) for n in whole)


def _actor_stats(roles, scored, micro: int):
    algo = dataclasses.replace(roles.config.algo, micro_batch_groups=micro)
    roles = dataclasses.replace(roles, config=dataclasses.replace(roles.config, algo=algo))
    roles.optimizer.zero_grad()
    stats = actor_backward(roles, scored, [0, 1, 2], None)
    roles.optimizer.zero_grad()
    return stats


def test_statistics_over_micro_batches_are_those_of_the_whole_batch(batch):
    """The statistics are summed on the device and read once per mini-batch: over three micro-batches
    they equal the one-pass values (token and clip counts exactly, the largest |Δ log p| exactly)."""
    roles, scored = batch
    whole, split = _actor_stats(roles, scored, 0), _actor_stats(roles, scored, 1)
    assert whole.tokens == split.tokens == 18
    assert whole.clip_fraction == split.clip_fraction
    assert whole.logprob_diff_max == split.logprob_diff_max
    for name in ("loss", "kl", "entropy", "logprob_diff_sum"):
        a, b = getattr(whole, name), getattr(split, name)
        assert isinstance(b, float) and abs(a - b) <= 1e-12 * max(1.0, abs(a)), name
    assert whole.entropy > 0 and whole.kl >= 0


def _host_sums(parts) -> dict:
    """The statistics as the host summed them before they were summed on the device: ``float()`` of
    each micro-batch's reductions, added in Python from 0.0, the maximum by Python's ``max``."""
    out = dict.fromkeys(
        ("loss", "kl", "clip_fraction", "entropy", "logprob_diff_max", "logprob_diff_sum"), 0.0
    )
    out["tokens"] = 0
    for loss, kl, clipped, entropy, logprobs, rollout_logprobs, mask in parts:
        diff = torch.where(mask, (logprobs - rollout_logprobs).abs(), 0.0)
        out["loss"] += float(loss)
        out["kl"] += float(torch.where(mask, kl, 0.0).sum())
        out["clip_fraction"] += float((clipped & mask).sum())
        out["entropy"] += float(torch.where(mask, entropy, 0.0).sum())
        out["logprob_diff_max"] = max(out["logprob_diff_max"], float(diff.max()) if diff.numel() else 0.0)
        out["logprob_diff_sum"] += float(diff.sum())
        out["tokens"] += int(mask.float().sum())
    return out


def test_device_sums_are_bitwise_the_host_sums():
    """Random float32 micro-batches, with a loss of -0.0 and a NaN log-prob among them: every statistic
    bitwise as the host summed it (a NaN maximum leaves the running one, as Python's max did)."""
    from rollplex.phases import _add_sums, _micro_sums, _stats

    g = torch.Generator().manual_seed(0)
    for case in range(200):
        parts = []
        for micro in range(1 + case % 4):
            shape = (2, 1 + (case + micro) % 5)
            lp = torch.randn(shape, generator=g)
            if (case + micro) % 7 == 3:
                lp[0, 0] = float("nan")
            loss = torch.tensor(-0.0) if (case + micro) % 5 == 1 else torch.randn((), generator=g)
            parts.append(
                (
                    loss,
                    torch.rand(shape, generator=g),
                    torch.rand(shape, generator=g) < 0.3,
                    torch.rand(shape, generator=g) * 5,
                    lp,
                    torch.randn(shape, generator=g),
                    torch.rand(shape, generator=g) < 0.8,
                )
            )
        sums = torch.zeros(7, dtype=torch.float64)
        for part in parts:
            sums = _add_sums(sums, _micro_sums(*part))
        got, want = vars(_stats(sums)), _host_sums(parts)
        for name, value in want.items():
            assert str(got[name]) == str(value), (case, name)  # bitwise, -0.0 and NaN included


def test_actor_backward_sums_its_micro_batches_from_zero(batch, monkeypatch):
    """``actor_backward`` starts its running sums at zero and adds each micro-batch's vector: planted
    vectors (a loss of -0.0 in each, a NaN maximum in the first) give what the host's sums from 0.0 gave."""
    from rollplex import phases

    nan = float("nan")
    planted = iter(
        torch.tensor(v, dtype=torch.float64)
        for v in (
            [-0.0, 1.0, 2.0, 3.0, nan, 0.5, 4.0],
            [-0.0, 1.5, 0.0, 1.0, 0.25, 0.25, 3.0],
            [-0.0, 0.5, 1.0, 2.0, 0.125, 0.125, 2.0],
        )
    )
    monkeypatch.setattr(phases, "_micro_sums", lambda *args: next(planted))
    roles, scored = batch
    stats = _actor_stats(roles, scored, 1)
    assert str(stats.loss) == "0.0" and stats.logprob_diff_max == 0.25
    assert (stats.kl, stats.clip_fraction, stats.entropy, stats.logprob_diff_sum, stats.tokens) == (
        3.0,
        3.0,
        6.0,
        0.875,
        9,
    )


def test_micro_batch_sums_by_hand():
    """Two micro-batches of hand-made values: sums of the masked entries, the larger maximum, counts."""
    from rollplex.phases import _add_sums, _micro_sums, _stats

    mask = torch.tensor([[True, True, False]])
    first = _micro_sums(
        torch.tensor(0.5),
        torch.tensor([[0.1, 0.2, 9.0]]),
        torch.tensor([[True, False, True]]),
        torch.tensor([[1.0, 2.0, 9.0]]),
        torch.tensor([[-1.0, -2.0, 0.0]]),
        torch.tensor([[-1.5, -1.75, 7.0]]),
        mask,
    )
    second = _micro_sums(
        torch.tensor(-0.25),
        torch.tensor([[0.3, 9.0, 9.0]]),
        torch.tensor([[True, True, True]]),
        torch.tensor([[4.0, 9.0, 9.0]]),
        torch.tensor([[-3.0, 0.0, 0.0]]),
        torch.tensor([[-3.125, 0.0, 0.0]]),
        torch.tensor([[True, False, False]]),
    )
    none, no = torch.zeros(1, 0), torch.zeros(1, 0, dtype=torch.bool)
    empty = _micro_sums(torch.tensor(0.0), none, no, none, none, none, no)
    assert empty.tolist() == [0.0] * 7  # a micro-batch without tokens adds nothing, its maximum 0
    stats = _stats(_add_sums(first, second))
    assert stats.loss == 0.25 and stats.tokens == 3 and stats.clip_fraction == 2.0
    assert stats.kl == pytest.approx(0.6, abs=1e-7) and stats.entropy == 7.0
    assert stats.logprob_diff_max == 0.5 and stats.logprob_diff_sum == 0.875


def test_the_first_update_is_exactly_on_policy(batch):
    """Without behaviour log-probs (one update per batch) the ratio is exactly 1: no token is clipped,
    and each micro-batch's loss is bitwise the aggregate of −A over its tokens (the KL term is exactly 0
    at step 0, where the reference is the actor); a ratio off 1 by the rollout's last-bit differences
    would change it."""
    from rollplex.algo.losses import aggregate

    roles, scored = batch
    algo = roles.config.algo
    assert algo.loss_agg == "token-mean" and algo.mini_batches == 1
    stats = _actor_stats(roles, scored, 1)
    assert stats.clip_fraction == 0.0 and stats.tokens == 18 and stats.kl == 0.0
    mask, n = scored.rollout.response_mask(), scored.rollout.group_size
    dtype = scored.rollout.logprobs.dtype
    want = 0.0
    for g in range(3):
        rows = slice(g * n, (g + 1) * n)
        loss_tok = -scored.advantages[rows, None].to(dtype).expand(n, mask.shape[1])
        want += float(
            aggregate(loss_tok, mask[rows], "token-mean", num_tokens=18, num_seqs=6, horizon=mask.shape[1])
        )
    assert stats.loss == want


def test_b11_the_dr_grpo_normaliser_is_the_configured_budget_not_the_batch_width(batch):
    """Field case B11: "seq-mean-token-sum-norm" divides by rollout.max_response_tokens, the budget, not
    by the width of the batch's response tensor. A budget of 8 over responses 4 wide halves every
    gradient against a budget of 4 (a power of two: the halving is exact)."""
    roles, scored = batch
    assert scored.rollout.responses.shape[1] == roles.config.rollout.max_response_tokens == 4
    wider = dataclasses.replace(roles.config.rollout, max_response_tokens=8)
    roles8 = dataclasses.replace(roles, config=dataclasses.replace(roles.config, rollout=wider))
    at4 = _gradients(roles, scored, "seq-mean-token-sum-norm", 0)
    at8 = _gradients(roles8, scored, "seq-mean-token-sum-norm", 0)
    assert max(float(g.abs().max()) for g in at4.values()) > 0
    assert at4.keys() == at8.keys() and all(torch.equal(2 * at8[n], at4[n]) for n in at4)

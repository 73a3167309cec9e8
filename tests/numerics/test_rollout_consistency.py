"""Rollout records the trainer's log-probs; decode from a shared prefix equals a full-sequence forward.

docs/numerics.md (rollout log-probs follow the trainer's definition; step-0 ratio 1), field cases B05
(vision ids are never sampled), B08, and the step-0 check in float32 on the CPU (≤ 1e-5).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from rollplex.algo.losses import policy_loss
from rollplex.models.forward import prefix_forward, suffix_logprobs
from rollplex.rollout.engine import SamplingParams, generate
from rollplex.rollout.sampler import support_mask
from tests.numerics.conftest import BANNED, IMAGE, V_START, full_logprobs, make_prompt, vocab_logprobs

N, T = 4, 0.9


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _prompts():
    return [
        make_prompt([4, 3], [("image", (1, 4, 6), 0.0)], seed=11),
        make_prompt([3, 2], [("video", (2, 4, 4), 1.0)], seed=12),
        make_prompt([7], [], seed=13),
    ]


def _params(max_tokens=8, eos=(1,), **kw):
    base = dict(
        temperature=T, top_p=1.0, top_k=0, max_tokens=max_tokens, eos_ids=eos, pad_id=2, banned_ids=BANNED
    )
    base.update(kw)
    return SamplingParams(**base)


def _rollout(model, prompts, params, seed=0):
    prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=False)
    g = torch.Generator().manual_seed(seed)
    return generate(model, prompts, prefix, group_size=N, params=params, tokenizer=_Tokenizer(), generator=g)


@pytest.mark.parametrize(
    ("window", "fused", "gate", "max_rows"),
    [
        (128, False, False, 64),
        (3, False, False, 64),
        (3, True, False, 64),
        (3, True, True, 12),
        (3, True, True, 11),
    ],
)
def test_recorded_logprobs_equal_trainer_and_oracle_float64(
    models, window, fused, gate, max_rows, monkeypatch
):
    """The decode step (rollout.decode) equals the trainer's suffix path and the full-sequence oracle,
    also when the own-key window grows in several pieces (window 3 over 8 tokens), with the q/k/v and
    gate/up products fused, and with the gate/up product and SiLU gate as one Triton kernel (allowed on
    the CPU here, through Triton's interpreter: it runs on CUDA only otherwise). With it, every layer of
    every step calls the kernel while the 12 rows are within its row limit (12), none above it (11);
    without ``fused_gate`` it is never called."""
    from rollplex.rollout import decode

    if gate:
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip(
                "CPU tensors run Triton only in its interpreter (CUDA: tests/numerics/test_gpu_paths)"
            )
    spy = []
    kernel = decode.gated_up_product
    monkeypatch.setattr(decode, "gated_up_product", lambda *a, **k: spy.append(1) or kernel(*a, **k))
    monkeypatch.setattr(decode, "fused_gate_runs", lambda device: True)
    monkeypatch.setattr(decode, "GATE_MAX_ROWS", max_rows)
    model, oracle = models
    prompts = _prompts()
    batch = _rollout(model, prompts, _params(graph_window=window, fused_projections=fused, fused_gate=gate))
    layers = model.config.text_config.num_hidden_layers
    rows, calls = batch.responses.shape[0], len(spy)
    assert rows == 12 and calls == (
        layers * (batch.responses.shape[1] - 1) if gate and rows <= max_rows else 0
    )
    mask = batch.response_mask()
    prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=True)
    trainer, _ = suffix_logprobs(
        model, prefix, batch.responses, group_size=N, temperature=T, banned_ids=BANNED
    )
    assert (trainer - batch.logprobs).abs()[mask].max() <= 1e-10
    for b in range(batch.responses.shape[0]):
        length = int(batch.response_lens[b])
        with torch.no_grad():
            ref = full_logprobs(oracle, prompts[b // N], batch.responses[b, :length], T)
        assert (batch.logprobs[b, :length] - ref).abs().max() <= 1e-10
    loss, clipped = policy_loss(trainer, trainer.detach(), torch.ones(trainer.shape[0]), 0.2, 0.28)
    assert not clipped[mask].any()


@pytest.mark.parametrize(("top_p", "top_k"), [(0.9, 0), (1.0, 5), (0.7, 3)])
def test_b08_top_p_top_k_rollouts_record_the_full_distributions_logprobs(models, top_p, top_k):
    """Field case B08 end to end: with top-p and/or top-k sampling, rollout records each token's
    log-prob under the whole distribution at T (what the trainer computes), not under the renormalised
    kept set, so the step-0 ratio is exactly 1 and nothing is clipped; float64 trainer and oracle agree
    to 1e-10. The renormalised value differs by more than 1e-3 for some token, so recording it would
    fail here. (The fused sampling race hands top-p and top-k to this eager path:
    tests/rollout/test_sample_kernel.py.)"""
    model, oracle = models
    prompts = _prompts()
    batch = _rollout(model, prompts, _params(top_p=top_p, top_k=top_k))
    mask = batch.response_mask()
    prefix = prefix_forward(model, prompts, temperature=T, banned_ids=BANNED, attached=True)
    trainer, _ = suffix_logprobs(
        model, prefix, batch.responses, group_size=N, temperature=T, banned_ids=BANNED
    )
    assert (trainer - batch.logprobs).abs()[mask].max() <= 1e-10
    _, clipped = policy_loss(trainer, batch.logprobs, torch.ones(trainer.shape[0]), 0.2, 0.28)
    assert not clipped[mask].any()
    renormalised_gap = 0.0
    for b in range(batch.responses.shape[0]):
        length = int(batch.response_lens[b])
        response = batch.responses[b, :length]
        with torch.no_grad():
            vocab = vocab_logprobs(oracle, prompts[b // N], response, T)
        chosen = vocab.gather(1, response[:, None]).squeeze(1)
        assert (batch.logprobs[b, :length] - chosen).abs().max() <= 1e-10
        kept = support_mask(vocab, top_p=top_p, top_k=top_k)
        assert kept.gather(1, response[:, None]).all()  # every sampled token was in the kept set
        kept_mass = torch.logsumexp(vocab.masked_fill(~kept, float("-inf")), dim=-1)
        renormalised_gap = max(renormalised_gap, float((-kept_mass).abs().max()))
    assert renormalised_gap > 1e-3


@pytest.mark.parametrize(
    ("attention", "fused_sampling"), [("dense", False), ("triton", False), ("triton", True)]
)
def test_step0_rollout_vs_trainer_float32(models, attention, fused_sampling, monkeypatch):
    """fp32 on CPU: rollout-recorded vs prefix+suffix log-probs agree to ≤ 1e-5, with the dense and
    the fused (Triton, interpreted on the CPU) decode attention, and with the fused sampling race (forced
    on here: it runs on CUDA only otherwise)."""
    from rollplex.rollout import decode

    spy = []
    if fused_sampling:
        monkeypatch.setattr(decode, "fused_sampling_runs", lambda device: True)
        race = decode.sample_kernel.fused_race
        monkeypatch.setattr(
            decode.sample_kernel, "fused_race", lambda *a, **k: spy.append(1) or race(*a, **k)
        )
    if attention == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip(
                "CPU tensors run Triton only in its interpreter (CUDA: tests/numerics/test_gpu_paths)"
            )
    model32 = copy.deepcopy(models[0]).float()
    prompts = _prompts()
    for p in prompts:
        p.pixel_values = None if p.pixel_values is None else p.pixel_values.float()
        p.pixel_values_videos = None if p.pixel_values_videos is None else p.pixel_values_videos.float()
    batch = _rollout(
        model32, prompts, _params(max_tokens=12, attention=attention, fused_sampling=fused_sampling)
    )
    prefix = prefix_forward(model32, prompts, temperature=T, banned_ids=BANNED, attached=True)
    trainer, _ = suffix_logprobs(
        model32, prefix, batch.responses, group_size=N, temperature=T, banned_ids=BANNED
    )
    diff = (trainer.detach() - batch.logprobs).abs()[batch.response_mask()]
    assert diff.max() <= 1e-5
    assert len(spy) == (11 if fused_sampling else 0)  # one race per decode step


def test_decode_setup_time_and_the_window_of_the_resolved_attention(models, monkeypatch):
    """The decoder resolves its graph window from the attention "auto" resolved to (dense on the CPU),
    and the rollout records its decode setup time: positive when a decode loop ran, 0 for one-token
    responses (no decode step)."""
    from rollplex.rollout import decode

    asked, resolve = [], decode.resolve_graph_window
    monkeypatch.setattr(decode, "resolve_graph_window", lambda *a: asked.append(a) or resolve(*a))
    model, _ = models
    prompts = _prompts()
    assert _rollout(model, prompts, _params(max_tokens=4)).setup_s > 0
    assert asked == [(0, "dense")]
    assert _rollout(model, prompts, _params(max_tokens=1)).setup_s == 0.0


def test_eos_lengths_and_padding(models):
    model, _ = models
    prompts = _prompts()
    eos_ids = tuple(range(3, 120))  # most tokens end a response: lengths vary from 1 up
    batch = _rollout(model, prompts, _params(max_tokens=6, eos=eos_ids))
    for b in range(batch.responses.shape[0]):
        length = int(batch.response_lens[b])
        row = batch.responses[b]
        if not batch.truncated[b]:
            assert int(row[length - 1]) in eos_ids
            assert all(int(t) not in eos_ids for t in row[: length - 1])
        assert (row[length:] == 2).all()
        assert (batch.logprobs[b, length:] == 0).all()
    assert batch.response_mask().sum() == batch.response_lens.sum()


def test_vision_ids_are_never_sampled(models):
    """B05: even when the model puts almost all mass on vision ids they are not generated."""
    model = copy.deepcopy(models[0])
    with torch.no_grad():
        model.lm_head.weight[IMAGE] *= 50
        model.lm_head.weight[V_START] *= 50
    batch = _rollout(model, _prompts(), _params(max_tokens=10))
    assert not torch.isin(batch.responses, BANNED).any()


def test_prefix_computed_once_per_group(models):
    """The vision tower runs once per group for the rollout prefix, not once per sample."""
    model = models[0]
    calls = []
    handle = model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    try:
        _rollout(model, _prompts(), _params(max_tokens=4))
    finally:
        handle.remove()
    assert len(calls) == 2  # two of the three prompts have media


def test_same_seed_same_rollout(models):
    model = models[0]
    a = _rollout(model, _prompts(), _params(), seed=7)
    b = _rollout(model, _prompts(), _params(), seed=7)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)


def test_decode_timeline_counts_decode_steps(models):
    """The timeline starts before the first decode step, marks the end of every round of
    ``eos_check_every`` steps and ends after the last step (the first token comes from the prefix, so R
    tokens take R - 1 decode steps; without graphs the last round runs only the steps left)."""
    batch = _rollout(models[0], _prompts(), _params(max_tokens=10, eos_check_every=4))
    steps = [s for s, _ in batch.timeline.marks]
    times = [t for _, t in batch.timeline.marks]
    assert steps == [0, 4, 8, 9] and times == sorted(times)
    assert batch.timeline.steps == 9 and batch.timeline.end >= batch.timeline.start


def test_decode_stops_once_every_row_has_finished(models):
    """Every token ends a response: all rows finish at position 0, and the loop stops after the
    round whose flag says so instead of running the whole budget."""
    batch = _rollout(models[0], _prompts(), _params(max_tokens=40, eos=tuple(range(1000)), eos_check_every=4))
    assert batch.timeline.steps == 4
    assert (batch.response_lens == 1).all() and not batch.truncated.any()


def test_flag_read_one_round_late_changes_only_when_decode_stops(models, monkeypatch):
    """CUDA reads each round's "all finished" flag one round late: one more round runs, and the
    rollout it returns is the same (the extra steps only pad finished rows)."""
    from rollplex.rollout import engine

    params = _params(max_tokens=40, eos=tuple(range(5, 1000)), eos_check_every=4)
    prompt_now = _rollout(models[0], _prompts(), params)

    class Late(engine._DecodeClock):
        def __init__(self, device):
            super().__init__(device)
            self.lag = 1

    monkeypatch.setattr(engine, "_DecodeClock", Late)
    late = _rollout(models[0], _prompts(), params)
    assert prompt_now.timeline.steps < 39 and late.timeline.steps == prompt_now.timeline.steps + 4
    for name in ("responses", "logprobs", "response_lens", "truncated"):
        assert torch.equal(getattr(late, name), getattr(prompt_now, name)), name

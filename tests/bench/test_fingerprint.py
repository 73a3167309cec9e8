"""``rollplex.bench.fingerprint``: the fingerprint against a plain-Python SplitMix64 oracle, what it tells
apart, CPU against CUDA, and the step and optimizer fingerprints."""

from __future__ import annotations

import math

import pytest
import torch

from rollplex.bench import fingerprint as fp

MASK = 2**64 - 1


def _splitmix_finaliser(word: int) -> int:
    """SplitMix64's finaliser on a 64-bit word, in Python integers (the published constants and shifts)."""
    word = (word * 0x9E3779B97F4A7C15) & MASK
    word = ((word ^ (word >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    word = ((word ^ (word >> 27)) * 0x94D049BB133111EB) & MASK
    return word ^ (word >> 31)


def _oracle(values: torch.Tensor) -> int:
    bits = values.reshape(-1).view(torch.int32).tolist()
    return sum(_splitmix_finaliser((b & 0xFFFFFFFF) | (i << 32)) for i, b in enumerate(bits)) & MASK


def test_the_fingerprint_is_the_splitmix_sum_written_out(monkeypatch):
    """Against Python integers: values with the sign bit set (negative words in torch's int64), NaN
    and infinities, a 2-D tensor, and several chunks."""
    x = torch.tensor([[1.0, -2.5, float("nan")], [float("inf"), -0.0, 5.3e-8]])
    assert fp.fingerprint(x) == _oracle(x)
    y = torch.randn(2500, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(fp, "_CHUNK", 1000)
    assert fp.fingerprint(y) == _oracle(y)


def test_the_finaliser_is_one_to_one_on_words_an_arithmetic_shift_would_merge():
    """x and ~x: an arithmetic shift sends both to the same word after the first step; SplitMix64's
    logical shifts do not (words of both signs, as int64)."""
    words = torch.tensor([0x33644661, 0x33644662, 5, ~5, -(2**63), 2**63 - 1], dtype=torch.int64)
    mixed = fp._mix(words).tolist()
    assert len(set(mixed)) == len(mixed)
    assert [m & MASK for m in mixed] == [_splitmix_finaliser(w & MASK) for w in words.tolist()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_the_cpus_fingerprint(monkeypatch):
    monkeypatch.setattr(fp, "_CHUNK", 4096)  # several chunks, int64 sums that wrap on both
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(2))
    assert fp.fingerprint(x.cuda()) == fp.fingerprint(x)


def test_updates_of_bf16_weights_with_a_tied_head_are_measured_from_the_initial_weights():
    """bf16 parameters with FP32 masters (ChunkedAdamW) and an output head tied to the embedding:
    ``Updates`` maps each master to its initial weight by name, and its update is the master minus
    that weight, so a row with the same update differs by 0 and one with a head step twice as long by
    a hand-computed ratio."""
    from rollplex.bench.schedule import Updates
    from rollplex.memory.chunked_adamw import ChunkedAdamW

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False)).to(torch.bfloat16)
    m[1].weight = m[0].weight  # tied, as published tied checkpoints
    initial = {k: v.clone() for k, v in m.state_dict().items()}

    def trained(lr):  # one model for every row, reset to the initial weights first, as the bench does
        m.load_state_dict(initial)
        optimizer = ChunkedAdamW(
            list(m.parameters()), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, chunk_elements=7
        )
        m(torch.tensor([1, 2])).float().sum().backward()
        optimizer.clip_and_step(0.0)
        return optimizer

    names = {id(p): n for n, p in m.named_parameters()}
    assert list(names.values()) == ["0.weight"]  # the tied head is the embedding's parameter
    updates = Updates(initial, names, ("serial", "serial-again", "both"))
    serial = trained(1e-3)
    updates.record("serial", serial, {"steps_taken": 1})
    same, longer = {"steps_taken": 1}, {"steps_taken": 1}
    updates.record("serial-again", trained(1e-3), same)
    both = trained(2e-3)
    updates.record("both", both, longer)
    u = _master(serial) - initial["0.weight"].float()
    want = float((_master(both) - initial["0.weight"].float() - u).norm() / u.norm())
    assert same["update_rel_diff_vs_serial"] == 0.0
    assert longer["update_rel_diff_vs_serial"] == pytest.approx(want, rel=1e-6) and want > 0.5


def _master(optimizer) -> torch.Tensor:
    """The FP32 master of the optimizer's first parameter."""
    return next(t for i, name, t in optimizer.state_tensors() if (i, name) == (0, "master"))


def test_a_fingerprint_tells_tensors_apart_whatever_the_pattern(monkeypatch):
    """Equal tensors give equal fingerprints, whatever the chunk size; one flipped low bit, two elements
    swapped, changes that cancel in a position-weighted sum (65,521 apart, or +1/-2/+1 in the last
    bit of neighbours) and a change past the first chunk all give different ones."""
    x = torch.randn(140_000, generator=torch.Generator().manual_seed(0))
    want = fp.fingerprint(x)
    assert fp.fingerprint(x.clone()) == want and 0 <= want < 2**64
    monkeypatch.setattr(fp, "_CHUNK", 1000)
    assert fp.fingerprint(x) == want

    def changed(edit) -> torch.Tensor:
        bits = x.clone().view(torch.int32)
        edit(bits)
        return bits.view(torch.float32)

    def swap(b, i, j):
        b[[i, j]] = b[[j, i]]

    def bump(b, deltas):
        for i, d in deltas:
            b[i] += d

    edits = [
        lambda b: b.__setitem__(7, b[7] ^ 1),
        lambda b: swap(b, 3, 4),
        lambda b: swap(b, 10, 10 + 65521),
        lambda b: bump(b, [(10, 1), (10 + 65521, -1)]),
        lambda b: bump(b, [(20, 1), (21, -2), (22, 1)]),
        lambda b: b.__setitem__(135_000, b[135_000] ^ 1),
    ]
    assert all(fp.fingerprint(changed(edit)) != want for edit in edits)
    with pytest.raises(TypeError, match="float32"):
        fp.fingerprint(x.double())


def test_the_optimizer_fingerprints_see_an_update_the_bf16_weights_do_not():
    """At a learning rate far under one bf16 step, two different gradients leave the same bf16 weights
    but different moments; ``differing`` counts them, and a tensor only one side has."""
    from rollplex.bench.fingerprint import differing, optimizer_fingerprints
    from rollplex.memory.chunked_adamw import ChunkedAdamW

    states = []
    for scale in (1.0, 2.0):
        weight = torch.nn.Parameter(torch.full((300,), 1.0, dtype=torch.bfloat16))
        optimizer = ChunkedAdamW(
            [weight], lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, chunk_elements=128
        )
        assert set(optimizer_fingerprints(optimizer)) == {(0, "master")}  # no moments before a step
        weight.grad = torch.full_like(weight, scale)
        optimizer.clip_and_step(0.0)
        states.append((weight.detach().clone(), optimizer_fingerprints(optimizer)))
    (w1, f1), (w2, f2) = states
    assert torch.equal(w1, w2) and set(f1) == {(0, "master"), (0, "exp_avg"), (0, "exp_avg_sq")}
    assert f1[(0, "master")] == f2[(0, "master")]  # the same sign-sized first step
    assert differing(f1, f2) == 2 and differing(f1, f1) == 0
    assert differing(f1, {(0, "master"): f1[(0, "master")]}) == 2


def test_step_fingerprints_say_where_two_runs_first_part():
    """Two runs' step fingerprints: the first step whose sampled tokens, recorded log-probs, advantages
    or reference log-probs differ, or None; a key one run lacks (KL off) is left out."""
    from types import SimpleNamespace

    from rollplex.bench.fingerprint import first_difference, step_fingerprints

    def scored(token: int, ref: float | None):
        rollout = SimpleNamespace(responses=torch.tensor([[1, token]]), logprobs=torch.tensor([[-0.5, -1.0]]))
        ref_lp = None if ref is None else torch.tensor([[ref, -1.0]])
        return SimpleNamespace(rollout=rollout, advantages=torch.tensor([0.5]), ref_logprobs=ref_lp)

    a = [step_fingerprints(scored(2, -0.5)), step_fingerprints(scored(3, -0.5))]
    b = [step_fingerprints(scored(2, -0.5)), step_fingerprints(scored(4, -0.25))]
    assert first_difference(a, b) == {
        "responses": 2,
        "rollout_logprobs": None,
        "advantages": None,
        "ref_logprobs": 2,
    }
    assert first_difference(a, a) == dict.fromkeys(a[0])
    no_kl = [step_fingerprints(scored(2, None)), step_fingerprints(scored(3, None))]
    assert first_difference(a, no_kl) == {"responses": None, "rollout_logprobs": None, "advantages": None}


def test_step_fingerprints_tell_the_training_forward_from_its_backward():
    """The actor's forward statistics and the gradient norms are fingerprinted from their float64 bits:
    a last-bit change in one norm, or in one field of one mini-batch's statistics, is seen, and only
    in its own key."""
    from types import SimpleNamespace

    from rollplex.bench.fingerprint import first_difference, step_fingerprints
    from rollplex.phases import ActorStats

    rollout = SimpleNamespace(responses=torch.tensor([[1, 2]]), logprobs=torch.tensor([[-0.5, -1.0]]))
    scored = SimpleNamespace(rollout=rollout, advantages=torch.tensor([0.5]), ref_logprobs=None)
    stats = [ActorStats(loss=0.25, kl=0.01, tokens=2), ActorStats(loss=-0.5, entropy=3.0, tokens=2)]
    norm = 1.5
    nudged = [stats[0], ActorStats(loss=-0.5, entropy=float.__add__(3.0, 2**-51), tokens=2)]
    base = step_fingerprints(scored, stats, [norm, 2.0])
    assert set(base) == {"responses", "rollout_logprobs", "advantages", "actor_statistics", "gradient_norms"}
    runs = {
        "same": step_fingerprints(scored, list(stats), [norm, 2.0]),
        "backward": step_fingerprints(scored, stats, [norm, math.nextafter(2.0, 3.0)]),
        "forward": step_fingerprints(scored, nudged, [norm, 2.0]),
    }
    assert first_difference([base], [runs["same"]]) == dict.fromkeys(base)
    assert first_difference([base], [runs["backward"]]) == {**dict.fromkeys(base), "gradient_norms": 1}
    assert first_difference([base], [runs["forward"]]) == {**dict.fromkeys(base), "actor_statistics": 1}
    assert set(step_fingerprints(scored)) == {"responses", "rollout_logprobs", "advantages"}

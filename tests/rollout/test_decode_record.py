"""DecodeRecord.write against hand-computed buffers: padding after a row's end, lengths at the EOS,
nothing counted at positions past the budget (scratch columns of the last round)."""

from __future__ import annotations

import torch

from rollplex.rollout.decode import DecodeRecord, SamplingParams, decode_steps


def _params(**kw):
    base = dict(temperature=1.0, top_p=1.0, top_k=0, max_tokens=3, eos_ids=(7, 9), pad_id=0)
    base.update(kw)
    return SamplingParams(banned_ids=torch.tensor([], dtype=torch.long), **base)


def _write(record, tokens, logprobs, position):
    record.write(torch.tensor(tokens), torch.tensor(logprobs), torch.tensor([position]))


def test_write_pads_after_the_end_and_ignores_positions_past_the_budget():
    record = DecodeRecord.empty(3, _params(eos_check_every=4), "cpu", torch.float32)
    assert record.responses.shape == (3, 5)  # 2 decode steps round up to one round of 4: columns 0..4
    _write(record, [5, 7, 6], [-1.0, -2.0, -3.0], 0)  # row 1 ends at position 0
    _write(record, [9, 4, 6], [-0.5, -0.25, -0.125], 1)  # row 0 ends at 1; row 1 is padded
    _write(record, [3, 3, 3], [-4.0, -4.0, -4.0], 2)
    _write(record, [8, 8, 9], [-6.0, -6.0, -6.0], 3)  # past the budget: row 2's EOS does not count
    assert record.responses[:, :3].tolist() == [[5, 9, 0], [7, 0, 0], [6, 6, 3]]
    assert record.logprobs[:, :3].tolist() == [[-1.0, -0.5, 0.0], [-2.0, 0.0, 0.0], [-3.0, -0.125, -4.0]]
    assert record.lengths.tolist() == [2, 1, 3]
    assert record.done.tolist() == [True, True, False]


def test_decode_steps_round_up_to_whole_rounds():
    assert decode_steps(_params(max_tokens=512, eos_check_every=16)) == (32, 512)
    assert decode_steps(_params(max_tokens=10, eos_check_every=4)) == (3, 12)
    assert decode_steps(_params(max_tokens=1, eos_check_every=4)) == (0, 0)

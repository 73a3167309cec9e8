"""DecodeRecord.write against hand-computed buffers: padding after a row's end, lengths at the EOS; the
decode loop's rounds."""

from __future__ import annotations

import torch

from rollplex.rollout.decode import DecodeRecord, SamplingParams, decode_steps


def _params(**kw):
    base = dict(temperature=1.0, top_p=1.0, top_k=0, max_tokens=3, eos_ids=(7, 9), pad_id=0)
    base.update(kw)
    return SamplingParams(banned_ids=torch.tensor([], dtype=torch.long), **base)


def _write(record, tokens, logprobs, position):
    record.write(torch.tensor(tokens), torch.tensor(logprobs), torch.tensor([position]))


def test_write_pads_after_the_end_and_records_lengths():
    record = DecodeRecord.empty(3, _params(max_tokens=4), "cpu", torch.float32)
    assert record.responses.shape == (3, 4)
    _write(record, [5, 7, 6], [-1.0, -2.0, -3.0], 0)  # row 1 ends at position 0
    _write(record, [9, 4, 6], [-0.5, -0.25, -0.125], 1)  # row 0 ends at 1; row 1 is padded
    _write(record, [3, 3, 3], [-4.0, -4.0, -4.0], 2)
    _write(record, [8, 8, 6], [-6.0, -6.0, -6.0], 3)  # row 2 never samples an EOS id: length R
    assert record.responses.tolist() == [[5, 9, 0, 0], [7, 0, 0, 0], [6, 6, 3, 6]]
    assert record.logprobs.tolist() == [
        [-1.0, -0.5, 0.0, 0.0],
        [-2.0, 0.0, 0.0, 0.0],
        [-3.0, -0.125, -4.0, -6.0],
    ]
    assert record.lengths.tolist() == [2, 1, 4]
    assert record.done.tolist() == [True, True, False]


def test_an_eos_at_the_last_position_ends_the_row():
    record = DecodeRecord.empty(2, _params(max_tokens=2), "cpu", torch.float32)
    _write(record, [5, 5], [-1.0, -1.0], 0)
    _write(record, [9, 5], [-1.0, -1.0], 1)
    assert record.lengths.tolist() == [2, 2] and record.done.tolist() == [True, False]


def test_decode_steps_count_rounds_and_steps():
    assert decode_steps(_params(max_tokens=512, eos_check_every=16)) == (32, 511)
    assert decode_steps(_params(max_tokens=10, eos_check_every=4)) == (3, 9)
    assert decode_steps(_params(max_tokens=1, eos_check_every=4)) == (0, 0)

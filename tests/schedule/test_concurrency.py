"""The schedule's stream helpers that need no GPU to check."""

from __future__ import annotations

import pytest
import torch

from rollplex.schedule.concurrency import cross_stream_backward

_get = getattr(torch._C, "_warn_on_accumulate_grad_stream_mismatch", None)
_set = getattr(torch._C, "_set_warn_on_accumulate_grad_stream_mismatch", None)


@pytest.mark.skipif(_get is None or _set is None, reason="this torch has no accumulate-grad stream warning")
@pytest.mark.parametrize("before", [True, False])
def test_cross_stream_backward_silences_the_warning_and_restores_it(before):
    """Off inside the body, the previous setting after it, also when the body raises."""
    original = _get()
    _set(before)
    try:
        with cross_stream_backward():
            assert _get() is False
        assert _get() is before
        with pytest.raises(RuntimeError), cross_stream_backward():
            raise RuntimeError("backward failed")
        assert _get() is before
    finally:
        _set(original)

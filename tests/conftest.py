"""Session-wide test setup.

Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU): ``TRITON_INTERPRET`` must
be set before Triton is first imported, so it is set here, before any test module loads.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def no_automatic_gc():
    """Python's automatic collection off for the test, so that only its own passes run (restored after)."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


@pytest.fixture(autouse=True)
def _seeded_global_generator():
    """Each test starts from torch's global generator seeded with 0, so a test that draws from it sees
    the same numbers run alone (``-k``) as in the whole suite, whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_vision_caches(monkeypatch):
    """Each test starts without kept vision layouts and chunk plans (models.vision_layout,
    models.attention keep them for the process), so what it counts does not depend on earlier tests."""
    from rollplex.models import attention, vision_layout

    monkeypatch.setattr(vision_layout, "_LAYOUTS", type(vision_layout._LAYOUTS)())
    monkeypatch.setattr(attention, "_PLANS", {})

"""A tiny float64 Qwen2.5-VL model routed through rollplex, and one short video prompt, for tests that
profile the model work."""

from __future__ import annotations

import pytest
import torch

from rollplex.models.forward import prepare_model
from tests.numerics.conftest import make_prompt, tiny_config


@pytest.fixture
def tiny_video():
    """(model, prompt): random tiny weights (seed 0), and a video prompt of grid (2, 4, 4)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config()).double()
    prepare_model(model)
    return model, make_prompt([3, 2], [("video", (2, 4, 4), 0.5)], seed=1)

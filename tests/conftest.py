"""Session-wide test setup.

Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU): ``TRITON_INTERPRET`` must
be set before Triton is first imported, so it is set here, before any test module loads.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

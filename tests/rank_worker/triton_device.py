"""Where the Triton kernel tests run: on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1 with
triton importable: the CPU build of torch comes without it, make setup installs it, and `make test-kernels`, a step
of `make test`, runs them so, less the cases marked slow_interpreter); `pytestmark = TRITON_MARKS` skips them
elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

from rank_worker.model import fused_ops

ON_CUDA = torch.cuda.is_available() and fused_ops.triton is not None
INTERPRETED = not ON_CUDA and os.environ.get("TRITON_INTERPRET") == "1" and fused_ops.triton is not None
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
TRITON_MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (ON_CUDA or INTERPRETED), reason="needs CUDA and Triton, or TRITON_INTERPRET=1 and triton"),
]

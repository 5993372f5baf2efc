"""The runtime's devices a test runs on: the CPU, and CUDA where there is one (skipped, with the reason, elsewhere)."""

from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA device on this machine"))]

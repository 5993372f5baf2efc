"""kvproof's import-time stand-in for ``torchvision`` (see ../README.md); no image op can run.

transformers sees a ``torchvision`` and reads a few names while importing
(``image_utils``); SGLang's multimodal helpers import ``torchvision.transforms``.
"""

from torchvision import io, transforms

__all__ = ["io", "transforms"]
__version__ = "0.0.0+kvproof.stub"


def unavailable(name: str) -> RuntimeError:
    return RuntimeError(f"torchvision.{name} called, but torchvision is kvproof's CPU stub")

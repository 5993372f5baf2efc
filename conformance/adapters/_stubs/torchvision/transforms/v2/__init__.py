"""Stand-in ``torchvision.transforms.v2``."""

from torchvision.transforms.v2 import functional

__all__ = ["functional"]

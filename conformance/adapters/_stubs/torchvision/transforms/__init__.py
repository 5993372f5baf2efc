"""Stand-in ``torchvision.transforms``: ``InterpolationMode`` (read at import by transformers and SGLang)."""

import enum

from torchvision.transforms import functional, v2


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__all__ = ["InterpolationMode", "functional", "v2"]

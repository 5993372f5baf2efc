"""Stand-in ``torchvision.io``."""

import enum
from typing import Any


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def decode_image(*args: Any, **kwargs: Any) -> Any:
    import torchvision

    raise torchvision.unavailable("io.decode_image")

"""Stand-in ``torchvision.transforms.functional``."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "InterpolationMode":  # defined in the package, imported lazily to avoid a cycle
        from torchvision.transforms import InterpolationMode

        return InterpolationMode
    raise AttributeError(f"kvproof's torchvision stub has no transforms.functional.{name}")


def pil_to_tensor(*args: Any, **kwargs: Any) -> Any:
    import torchvision

    raise torchvision.unavailable("transforms.functional.pil_to_tensor")

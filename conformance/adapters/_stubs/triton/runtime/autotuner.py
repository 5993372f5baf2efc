"""Stand-in ``triton.runtime.autotuner``: the types torch imports."""


class OutOfResources(Exception):
    """``triton.runtime.autotuner.OutOfResources``."""


class Autotuner:
    """``triton.runtime.autotuner.Autotuner`` (a type torch's repro tooling imports)."""


class Heuristics:
    """``triton.runtime.autotuner.Heuristics``."""

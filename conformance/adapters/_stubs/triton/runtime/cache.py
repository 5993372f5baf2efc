"""Stand-in ``triton.runtime.cache``."""


def triton_key() -> str:
    """Cache key torch folds into its own; constant for the stub."""
    return "kvproof-triton-stub"

"""Stand-in ``triton.backends``."""

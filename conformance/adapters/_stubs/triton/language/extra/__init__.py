"""Stand-in ``triton.language.extra``."""

"""How a run draws its examples and who shrinks a failure: the choices ``run_check``, the command line and the pytest
plugin share, declared once here (a module without imports: the command line and the plugin read it without loading
the harness)."""

__all__ = ["DEFAULT_ENGINE", "DEFAULT_SHRINKER", "ENGINES", "SHRINKERS"]

#: How a run draws its examples: Hypothesis' engine, or the breadth driver (kvproof.conformance.breadth).
ENGINES = ("hypothesis", "breadth")
#: Who shrinks a failure: Hypothesis (its shrink phase, on the choice sequence) or kvproof's vector shrinker
#: (:mod:`kvproof.conformance.shrink`: replaying candidate vectors). The breadth engine always takes the vector.
SHRINKERS = ("hypothesis", "vector")
#: The default of each: every entry point (run_check, a campaign, the command line, the plugin) takes these.
DEFAULT_ENGINE, DEFAULT_SHRINKER = ENGINES[0], SHRINKERS[0]

"""How a run draws its examples and who shrinks a failure: the choices ``run_check``, the command line and the pytest
plugin share, declared once here (a module without imports: the command line and the plugin read it without loading
the harness)."""

__all__ = ["CAMPAIGN_SHRINKER", "DEFAULT_ENGINE", "DEFAULT_SHRINKER", "ENGINES", "SHRINKERS"]

#: How a run draws its examples: Hypothesis' engine, or the breadth driver (kvproof.conformance.breadth).
ENGINES = ("hypothesis", "breadth")
#: Who shrinks a failure: Hypothesis (its shrink phase, on the choice sequence) or kvproof's vector shrinker
#: (:mod:`kvproof.conformance.shrink`: replaying candidate vectors). The breadth engine always takes the vector.
SHRINKERS = ("hypothesis", "vector")
#: The default of each: every entry point (run_check, the command line, the plugin) takes these, but a campaign's
#: shrinker. Hypothesis' shrinker stays the default of a conformance run: the pinned outputs, the kill matrix's
#: evidence and the findings' documented traces were made with it.
DEFAULT_ENGINE, DEFAULT_SHRINKER = ENGINES[0], SHRINKERS[0]
#: A campaign's (``kvproof fuzz``) default shrinker: the vector shrinker. A worker shrinks a failure before it
#: searches on, and over the mutants of four components that shrink took 12.6 s against 583 s for Hypothesis', with
#: 150 steps in all against 179 (README, "Fuzzing campaigns"): the campaign's budget goes to the search.
CAMPAIGN_SHRINKER = SHRINKERS[1]

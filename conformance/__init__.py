"""``kvproof.conformance``: lockstep conformance suites that drive the reference and any implementation.

One suite per component of the registry (``kvproof.reference.registry``), in the module
named after it: ``swa_allocator``, ``loc_cache``, ``decode_prealloc``, ``hisparse_host``.
Each is a Hypothesis rule-based state machine written in the framework of
:mod:`.lockstep`: every rule declares once the operation it performs (named like the
reference function and the implementation's method), its capability needs and its
misuse cases; it runs the operation on the pure reference (``kvproof.reference``) and on
the implementation under test, requires the same outcome, and compares the observable
state after every step. What a run finds explains itself (the operation, the step, the
values, the trace, a replay command) and is kept as a replayable vector (:mod:`.vector`).

Entry points, all over one planner (:mod:`.plan`):

* Python: :func:`kvproof.conformance.check.run_check` / ``check`` (trio style), and
  ``kill_mutants`` for the deliberately broken runtimes of :mod:`.mutants`;
* the command line: ``kvproof conform`` / ``check`` / ``mutants`` / ``replay``;
* pytest: ``pytest --pyargs kvproof.conformance.suite --kvproof-impl module:factory``
  (:mod:`.pytest_plugin`).

The contract an implementation meets (capabilities, protocols) is
``kvproof.reference.contract``; adapters for the real SGLang 0.5.23 pools are in
:mod:`.adapters`. Errors: :mod:`.errors` (verdicts vs harness errors).
"""

"""``kvproof conform``: the lockstep suite against an implementation, one row per pool config."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.table import Table

from kvproof.cli.impl import load_factory
from kvproof.conformance.check import (
    DEFAULT_OP_TIMEOUT,
    CheckReport,
    MutantVerdict,
    get_suite,
    impl_for,
    kill_mutants,
    run_check,
)
from kvproof.conformance.profiles import get_profile
from kvproof.conformance.report import Outcome, RunInfo, Selection, forced_seed, impl_version

__all__ = ["conform", "conform_outcomes", "conform_table", "run_mutants", "mutants_table"]


def conform(factory: Callable | None, impl_spec: str | None, profile: str, labels: Sequence[str] = (),
            on_report: Callable[[CheckReport], None] | None = None,
            components: Sequence[str] = ("swa_allocator",), policy: str = "corrected") -> list[CheckReport]:
    """Each component's suite on its configs (or those ``labels`` name): the reports of the tests that ran."""
    outcomes, _ = conform_outcomes(factory, impl_spec, profile, labels, on_report, components, policy)
    return [o.report for o in outcomes if o.report is not None]


def conform_outcomes(factory: Callable | None, impl_spec: str | None, profile: str, labels: Sequence[str] = (),
                     on_report: Callable[[CheckReport], None] | None = None,
                     components: Sequence[str] = ("swa_allocator",), policy: str = "corrected", *,
                     selection: Selection | None = None, seed: int | None = None,
                     op_timeout: float | None = DEFAULT_OP_TIMEOUT,
                     impls: Sequence[tuple[str, Callable]] = ()) -> tuple[list[Outcome], RunInfo]:
    """Run the suites against ``factory`` (or each suite's default) and classify every test.

    A label that names no config of any selected component is an error (``ValueError``
    listing the labels), never a silent no-op. ``selection`` skips or expects failures
    (entries matching nothing are warnings in the returned :class:`RunInfo`). ``impls``
    (``(spec, factory)`` pairs) serve the components their factories declare in
    ``components`` (an undeclared factory serves any); a component no given factory
    serves is an error.
    """
    suites = [get_suite(c) for c in components]
    known = {cfg.label() for suite in suites for cfg in suite.configs}
    unknown = [x for x in labels if x not in known]
    if unknown:
        raise ValueError(f"unknown config(s) {unknown}; choose from {sorted(known)}")
    selection = selection or Selection()
    outcomes: list[Outcome] = []
    versions: set[str] = set()
    given = list(impls) or ([(impl_spec or "impl", factory)] if factory is not None else [])
    with forced_seed(seed, get_profile(profile).derandomize) as used_seed:
        for suite in suites:
            spec, make = impl_for(suite.component, given)
            if make is None:
                spec, make = impl_spec or suite.default_impl, load_factory(impl_spec or suite.default_impl)
            options = _options(suite.component, policy)
            for cfg in (c for c in suite.configs if not labels or c.label() in labels):
                test_id = f"{suite.component}/{cfg.label()}"
                chosen = selection.match(test_id)
                if chosen and chosen[0] == "skip":
                    outcomes.append(Outcome(suite.component, cfg.label(), "skipped", chosen[1]))
                    continue
                replay = (f"kvproof conform --component {suite.component} --impl {spec} --config {cfg.label()} "
                          f"--profile {profile}" + (f" --policy {policy}" if options else "")
                          + (f" --seed {used_seed}" if isinstance(used_seed, int) else ""))
                report = run_check(suite.component, make, cfg, profile=profile, impl_name=spec, replay=replay,
                                   op_timeout=op_timeout, **options)
                versions.add(report.impl_version or impl_version(None, make))
                status = "passed" if report.passed else "failed"
                if chosen:  # an expected failure
                    status = "xpassed" if report.passed else "xfailed"
                outcomes.append(Outcome(suite.component, cfg.label(), status, chosen[1] if chosen else "", report))
                if on_report:
                    on_report(report)
    spec_names = ", ".join(spec for spec, _ in given) or ", ".join(get_suite(c).default_impl for c in components)
    info = RunInfo(spec_names, "; ".join(sorted(versions)) or "unknown", used_seed, profile,
                   tuple(selection.unmatched()))
    return outcomes, info


def _options(component: str, policy: str) -> dict[str, object]:
    """Machine options of a component: the decode node's admission policy."""
    if component != "decode_prealloc":
        return {}
    from kvproof.conformance.decode_prealloc import DEFAULT_DECODE_CONFIG
    from kvproof.reference.decode_prealloc import PreallocPolicy

    return {"decode_config": DEFAULT_DECODE_CONFIG.model_copy(update={"policy": PreallocPolicy(policy)})}


def conform_table(reports: list[CheckReport]) -> Table:
    table = Table(title="kvproof conform")
    for col in ("component", "config", "verdict", "examples", "steps", "ok", "OutOfMemory", "InvalidOperation", "n/a",
                "seconds"):
        table.add_column(col, justify="left" if col in ("component", "config", "verdict") else "right")
    for r in reports:
        verdict = "[green]pass[/]" if r.passed else "[red]FAIL[/]"
        table.add_row(r.component, r.config.label(), verdict, str(r.examples), str(r.steps), str(r.outcomes.get("ok", 0)),
                      str(r.outcomes.get("OutOfMemory", 0)), str(r.outcomes.get("InvalidOperation", 0)),
                      str(len(r.not_applicable)), f"{r.seconds:.1f}")
    return table


def run_mutants(profile: str) -> list[MutantVerdict]:
    """Every component's runtime mutants against that component's suite."""
    from kvproof.conformance.mutants import MUTANTS

    verdicts = []
    for component, mutants in MUTANTS.items():
        verdicts += kill_mutants(mutants, profile=profile, component=component)
    return verdicts


def mutants_table(verdicts: list[MutantVerdict]) -> Table:
    table = Table(title="kvproof mutants (runtime variants that must be killed)")
    for col in ("component", "mutant", "verdict", "caught on", "seconds", "what diverged"):
        table.add_column(col, justify="right" if col == "seconds" else "left", overflow="fold")
    for v in verdicts:
        mark = "[green]killed[/]" if v.killed else "[red]SURVIVED[/]"
        table.add_row(v.component, v.name, mark, v.config or "-", f"{v.seconds:.1f}", v.evidence[:100])
    return table

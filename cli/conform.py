"""``kvproof conform``: the lockstep suite against an implementation, one row per pool config."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.table import Table

from kvproof.conformance.check import CheckReport, MutantVerdict, kill_mutants, run_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS, config_by_label
from kvproof.reference.config import PoolConfig

__all__ = ["conform", "conform_table", "run_mutants", "mutants_table"]


def conform(factory: Callable, impl_spec: str, profile: str, labels: Sequence[str] = (),
            on_report: Callable[[CheckReport], None] | None = None,
            components: Sequence[str] = ("swa_allocator",), policy: str = "corrected") -> list[CheckReport]:
    configs: Sequence[PoolConfig] = [config_by_label(x) for x in labels] or CONFORMANCE_CONFIGS
    reports = []
    for component in components:
        options = _options(component, policy)
        for cfg in configs:
            replay = (f"kvproof conform --component {component} --impl {impl_spec} --config {cfg.label()} "
                      f"--profile {profile}" + (f" --policy {policy}" if options else ""))
            report = run_check(component, factory, cfg, profile=profile, impl_name=impl_spec, replay=replay,
                               **options)
            reports.append(report)
            if on_report:
                on_report(report)
    return reports


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
        verdicts += kill_mutants(mutants, CONFORMANCE_CONFIGS, profile=profile, component=component)
    return verdicts


def mutants_table(verdicts: list[MutantVerdict]) -> Table:
    table = Table(title="kvproof mutants (runtime variants that must be killed)")
    for col in ("component", "mutant", "verdict", "caught on", "seconds", "what diverged"):
        table.add_column(col, justify="right" if col == "seconds" else "left", overflow="fold")
    for v in verdicts:
        mark = "[green]killed[/]" if v.killed else "[red]SURVIVED[/]"
        table.add_row(v.component, v.name, mark, v.config or "-", f"{v.seconds:.1f}", v.evidence[:100])
    return table

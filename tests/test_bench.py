"""``kvproof bench`` runs end to end and reports positive numbers (no assertion on speed)."""

from rich.console import Console

from kvproof.cli.bench import run_bench


def test_bench_quick_reports_every_measure() -> None:
    console = Console(record=True, width=120)
    numbers = run_bench(console, quick=True)
    assert set(numbers) == {"pairs_p1", "pairs_p4", "ref_pairs_p4", "steps_per_s", "overhead", "translate_hit_us",
                            "translate_miss_us", "host_backup_tokens_per_s", "host_backup_batched_vs_one",
                            "host_backup_vs_reference", "watchdog_cost", "admission_decisions_per_s",
                            "admission_reference_decisions_per_s", "isolated_steps_per_s", "isolation_cost",
                            "isolation_start_ms", "tp_sync_ms_2", "tp_sync_ms_4", "tp_check_ms_2", "tp_check_ms_4",
                            "tp_lockstep_prefetches_per_s", "tp_lockstep_steps_per_s", "breadth_steps_per_s",
                            "breadth_vs_hypothesis", "fuzz_one_worker_steps_per_s", "fuzz_all_workers_steps_per_s",
                            "fuzz_scaling", "fuzz_breadth_steps_per_s", "fuzz_breadth_vs_hypothesis",
                            "block_pool_steps_per_s", "block_pool_reference_steps_per_s",
                            "block_pool_vs_reference", "block_pool_lockstep_steps_per_s", "breadth_bound",
                            "engine_alone_us", "hypothesis_ceiling",
                            *(f"{mode}_us_{part}" for mode in ("hypothesis", "breadth")
                              for part in ("implementation", "reference", "checks", "driver"))}
    assert all(value > 0 for value in numbers.values())
    # the split of a step adds up to the step, and no part is counted twice (the driver's share is what is left)
    hypothesis_step = sum(numbers[f"hypothesis_us_{part}"] for part in ("implementation", "reference", "checks",
                                                                         "driver"))
    assert abs(hypothesis_step - 1e6 / numbers["steps_per_s"]) < 1e-6 * hypothesis_step
    assert numbers["breadth_bound"] > numbers["breadth_vs_hypothesis"]
    # the ceiling: one step of the engine alone plus the default mode's implementation, reference and checks (no
    # assertion that it exceeds the measured rate: that compares two timings)
    ceiling_step = numbers["engine_alone_us"] + sum(numbers[f"hypothesis_us_{part}"] for part in (
        "implementation", "reference", "checks"))
    assert abs(numbers["hypothesis_ceiling"] - 1e6 / ceiling_step) < 1e-6 * numbers["hypothesis_ceiling"]
    text = console.export_text()
    assert "lockstep steps/s in-process / process-isolated" in text
    assert "harness overhead" in text and "hisparse_host backup: batched / one request per call" in text
    assert "admission add_one_req decisions/s" in text and "requests one round admits" in text
    assert "upstream_27391" in text and "OOM" in text  # S8's row: pre_27391 admits, then runs out
    assert "tp_prefetch hit sync per prefetch, 2 / 4 ranks (ms)" in text
    assert "us per step, breadth mode: implementation / reference / checks / driver" in text
    assert "Hypothesis' engine alone on the suite's rules" in text and "hypothesis mode ceiling, steps/s" in text
    assert "breadth / hypothesis mode steps/s (one core)" in text and "kvproof fuzz steps/s, 1 worker / " in text
    assert "workers / 1 worker (ideal" in text and "kvproof fuzz --mode breadth / hypothesis, 1 worker" in text
    assert "block_pool scheduler steps/s" in text and "block_pool lockstep steps/s" in text


def test_bench_bugs_finds_a_planted_bug_in_both_modes_and_reports_coverage() -> None:
    """``kvproof bench --bugs`` on one component (its first mutant, one seed): found in both modes, with the steps to
    detect it and a shrunk length; the coverage table reaches every declared dimension of the component."""
    from kvproof.cli.bench_bugs import run_bug_bench

    console = Console(record=True, width=250)
    results = run_bug_bench(console, quick=True, components=["hisparse_host"], seeds=1)
    bugs = {k: v for k, v in results.items() if "/coverage/" not in k}
    assert len(bugs) == 2  # the first mutant, two modes
    for summary in bugs.values():
        assert summary["found"] == 1 and summary["steps"] > 0 and summary["seconds"] > 0, summary
        assert summary["shrunk"] is not None and 1 <= summary["shrunk"] <= summary["steps"], summary
    for mode in ("hypothesis", "breadth"):
        cov = results[f"hisparse_host/coverage/{mode}"]
        assert cov["steps_per_s"] > 0 and 0 < cov["rules_run"] <= cov["rules"]
        assert cov["structure"] > 0 and cov["structure_at_max"] <= cov["structure"]
    assert cov["structure_at_max"] == cov["structure"]  # breadth's swarm reaches every dimension on this budget
    text = console.export_text()
    assert "time to detect, median over 1 seeds" in text and "rerun: kvproof bench --bugs --quick --seeds 1" in text
    assert "every bug: breadth sooner " in text and "x) over 1 bugs" in text
    assert "seeds that found their bug: hypothesis 1/1, breadth 1/1" in text


def _summary(found: int, seconds: float, steps: int) -> dict[str, object]:
    return {"found": found, "seeds": 5, "seconds": seconds if found else None, "steps": steps if found else None,
            "shrunk": 3 if found else None}


def test_sooner_is_the_geometric_mean_over_the_bugs_both_modes_found() -> None:
    """Hypothesis' median over breadth's, per bug both found, geometric mean; a bug one mode alone found is counted
    apart and in no ratio; other components and the coverage rows are left out; a step counts as at least 1."""
    from kvproof.cli.bench_bugs import sooner
    from kvproof.reference.registry import Component

    results = {
        "swa_allocator/a/hypothesis": _summary(5, 8.0, 800), "swa_allocator/a/breadth": _summary(5, 1.0, 100),
        "swa_allocator/b/hypothesis": _summary(3, 1.0, 0), "swa_allocator/b/breadth": _summary(1, 2.0, 4),
        "swa_allocator/c/hypothesis": _summary(2, 9.0, 9), "swa_allocator/c/breadth": _summary(0, 0.0, 0),
        "swa_allocator/coverage/hypothesis": {"steps_per_s": 1.0}, "swa_allocator/coverage/breadth": {},
        "loc_cache/d/hypothesis": _summary(0, 0.0, 0), "loc_cache/d/breadth": _summary(4, 0.5, 30),
    }
    swa = sooner(results, Component.SWA_ALLOCATOR)
    assert swa.bugs == 2 and swa.found_by_one == {"hypothesis": 1, "breadth": 0}
    assert abs(swa.seconds - 2.0) < 1e-9  # sqrt(8 / 1 * 1 / 2)
    assert abs(swa.steps - (8 * 1 / 4) ** 0.5) < 1e-9  # b: hypothesis' 0 steps count as 1
    assert swa.seeds == {"hypothesis": (10, 15), "breadth": (6, 15)}
    assert swa.cell() == "2.00x (1.41x) over 2 bugs; 1 hypothesis only"
    overall = sooner(results)
    assert overall.bugs == 2 and overall.found_by_one == {"hypothesis": 1, "breadth": 1}
    assert overall.seeds == {"hypothesis": (10, 20), "breadth": (10, 20)}
    nothing = sooner(results, Component.LOC_CACHE)
    assert nothing.bugs == 0 and nothing.seconds is None and nothing.cell() == "-"


def test_a_correct_implementation_is_never_found() -> None:
    """The measurement can fail: the runtime itself, planted as a "bug", is found by no mode."""
    from kvproof.cli.bench_bugs import BugTarget, detect
    from kvproof.conformance.plan import load_impls, plan
    from kvproof.reference.registry import Component

    tests = plan(("hisparse_host",), load_impls(()), (), None, {}).tests[:1]
    target = BugTarget(Component.HISPARSE_HOST, "no bug", tests, tests[0].impl.factory)
    for mode in ("hypothesis", "breadth"):
        run = detect(target, mode, 0)
        assert not run.found and run.shrunk is None and run.steps > 0

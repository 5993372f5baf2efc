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
                            *(f"{mode}_us_{part}" for mode in ("hypothesis", "breadth")
                              for part in ("implementation", "reference", "checks", "driver"))}
    assert all(value > 0 for value in numbers.values())
    # the split of a step adds up to the step, and no part is counted twice (the driver's share is what is left)
    hypothesis_step = sum(numbers[f"hypothesis_us_{part}"] for part in ("implementation", "reference", "checks",
                                                                         "driver"))
    assert abs(hypothesis_step - 1e6 / numbers["steps_per_s"]) < 1e-6 * hypothesis_step
    assert numbers["breadth_bound"] > numbers["breadth_vs_hypothesis"]
    text = console.export_text()
    assert "lockstep steps/s in-process / process-isolated" in text
    assert "harness overhead" in text and "hisparse_host backup: batched / one request per call" in text
    assert "admission add_one_req decisions/s" in text and "requests one round admits" in text
    assert "upstream_27391" in text and "OOM" in text  # S8's row: pre_27391 admits, then runs out
    assert "tp_prefetch hit sync per prefetch, 2 / 4 ranks (ms)" in text
    assert "us per step, breadth mode: implementation / reference / checks / driver" in text
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

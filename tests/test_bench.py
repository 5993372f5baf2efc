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
                            "tp_lockstep_prefetches_per_s", "tp_lockstep_steps_per_s"}
    assert all(value > 0 for value in numbers.values())
    text = console.export_text()
    assert "lockstep steps/s in-process / process-isolated" in text
    assert "harness overhead" in text and "hisparse_host backup: batched / one request per call" in text
    assert "admission add_one_req decisions/s" in text and "requests one round admits" in text
    assert "upstream_27391" in text and "OOM" in text  # S8's row: pre_27391 admits, then runs out
    assert "tp_prefetch hit sync per prefetch, 2 / 4 ranks (ms)" in text

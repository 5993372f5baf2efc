"""``kvproof bench``: speed of the harness and of the runtime, as ratios measured in one run.

Nothing here is a timed test: it prints numbers, it never asserts on them.

* lockstep steps/s: the ``swa_allocator`` state machine against kvproof's torch
  runtime under a fixed derandomized profile (steps = checked transitions), under Hypothesis' engine (the
  default mode) and under the breadth driver (``kvproof fuzz --mode breadth``: the same rules and checks), on one
  core (one torch thread), the best of three alternating runs of each, and their ratio;
* a floor under the default mode's driver: Hypothesis' engine alone on the suite's rule alphabet (the same rules
  and argument strategies, empty bodies and checks), and the default mode's ceiling it gives with the
  implementation, the reference and the checks as measured (the harness' own bookkeeping at nothing);
* ``kvproof fuzz`` throughput: lockstep steps/s of a campaign over the ``swa_allocator`` slices with one worker
  and with one per core (each for the same wall-clock budget, in a scratch directory), and their ratio; and of one
  worker in the breadth mode, against one in the default mode;
* runtime throughput: ``alloc_extend`` (one request, 0 -> n tokens, n in 1..64) +
  ``free`` pairs per second at page size 1 and 4, on the runtime's default device,
  and the same pairs on the pure-Python reference over the same 16k-token pool;
* harness overhead = (time of one lockstep step) / (time of one bare runtime op),
  where a bare op is half of an alloc_extend+free pair at page size 4; and the price
  of the per-operation timeout (steps/s calling the implementation directly vs under
  the deadline);
* the price of isolation (:mod:`kvproof.conformance.isolation`): lockstep steps/s in
  kvproof's process vs each config in a supervised child (the default), and the start
  cost of one child (fork, pipe, result, reap; paid once per config);
* ``loc_cache``: the cost of ``translate_loc_from_full_to_swa`` on a cache hit and on a
  miss (invalidate + gather), for 64 and 4096 slots;
* with SGLang installed (``make sglang``): ``alloc``/``alloc_extend`` + ``free`` ops/s of
  kvproof's runtime and of SGLang 0.5.23's allocator on the same sequence, P = 1 and 4;
* ``hisparse_host``: tokens/s of the per-step eager backup (a batch of running requests,
  P_h = 64, pages opened as positions cross page boundaries) on the runtime in one
  vectorised call per step, on the runtime one request per call, and on the reference;
* ``tp_prefetch``: per prefetch on a real group of 2 and of 4 rank processes (gloo on loopback), the milliseconds
  of the storage-hit sync (one all-reduce and the command round trip) and of the whole check (five operations,
  the commit included), their ratio, the group's start; and the lockstep's checked prefetches per second;
* ``block_pool``: scheduler steps per second (admission with a prefix lookup, prefill chunks, decodes,
  out-of-window releases, finishes, over prompts sharing prefixes) of vLLM 0.33.0's manager as kvproof models it:
  kvproof's torch runtime and the pure reference on the same seeded sequence, and the lockstep's checked steps/s
  against the runtime;
* ``admission``: ``add_one_req`` decisions per second (each with its match, in rounds of 8
  requests over a HiCache tree, load-back and the round's allocation included) on the runtime
  and on the reference, and a table of how many requests one round admits under each policy
  for a few (W, P, host tombstone length, pool size) settings ("OOM": admitted, then out of
  SWA memory, S8).
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import settings
from rich.console import Console
from rich.table import Table

from kvproof.conformance.check import DEFAULT_OP_TIMEOUT, run_swa_allocator_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.errors import HarnessBug
from kvproof.conformance.modes import DEFAULT_ENGINE
from kvproof.conformance.profiles import get_profile
from kvproof.gpu_runtime.admission import AdmissionRuntime
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool
from kvproof.gpu_runtime.paged import default_device
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator
from kvproof.reference import admission as ad
from kvproof.reference import hisparse_host as hh
from kvproof.reference import swa_allocator as ref
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import OutOfMemory
from kvproof.reference.registry import Component, parse_components

__all__ = [
    "SECTIONS",
    "LockstepRate",
    "Section",
    "admission_decisions_per_second",
    "admission_round_table",
    "lockstep_rate",
    "reference_pairs_per_second",
    "run_bench",
    "runtime_pairs_per_second",
]


def _lengths(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 64) for _ in range(count)]


def _bench_config(page_size: int) -> PoolConfig:
    """One pool size for the runtime and the reference, so their ratio compares like with like."""
    return PoolConfig(size_full=1 << 14, size_swa=1 << 13, page_size=page_size, sliding_window_size=128)


def runtime_pairs_per_second(page_size: int, pairs: int) -> tuple[float, str]:
    """alloc_extend(0 -> n) + free pairs per second on the torch runtime; also returns the device."""
    cfg = _bench_config(page_size)
    alloc = SWATokenToKVPoolAllocator(cfg)
    dev = alloc.device
    zero, zero_cpu, minus = torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64), \
        torch.full((1,), -1, dtype=torch.int64, device=dev)
    seqs = [(torch.tensor([n], device=dev), torch.tensor([n]), n) for n in _lengths(pairs)]
    for seq, seq_cpu, n in seqs[:50]:  # warm-up
        alloc.free(alloc.alloc_extend(zero, zero_cpu, seq, seq_cpu, minus, n))
    _sync(dev)
    start = time.perf_counter()
    for seq, seq_cpu, n in seqs:
        alloc.free(alloc.alloc_extend(zero, zero_cpu, seq, seq_cpu, minus, n))
    _sync(dev)
    return pairs / (time.perf_counter() - start), str(dev)


def reference_pairs_per_second(page_size: int, pairs: int) -> float:
    """The same pairs on the pure-Python reference (for context: the oracle's own cost)."""
    state = ref.initial_state(_bench_config(page_size))
    start = time.perf_counter()
    for n in _lengths(pairs):
        state, slots = ref.alloc_extend(state, [0], [n], [-1], n)
        state = ref.free(state, slots)
    return pairs / (time.perf_counter() - start)


@dataclass(frozen=True)
class LockstepRate:
    """Checked lockstep steps over all conformance configs, the seconds they took, and where those seconds went
    (``CheckReport.split``: implementation calls, reference operations, per-step checks; the rest is the driver's)."""

    steps: int
    seconds: float
    split: dict[str, float]

    @property
    def per_second(self) -> float:
        return self.steps / self.seconds

    def micros(self, part: str) -> float:
        """Microseconds per step spent in ``part`` (``driver``: what the three parts leave)."""
        spent = self.seconds - sum(self.split.values()) if part == "driver" else self.split.get(part, 0.0)
        return spent / self.steps * 1e6


def lockstep_rate(examples: int, op_timeout: float | None = DEFAULT_OP_TIMEOUT, isolation: str = "in-process",
                  engine: str = DEFAULT_ENGINE) -> LockstepRate:
    """Checked lockstep steps against the runtime, over all conformance configs.

    ``op_timeout=None`` calls the implementation directly (no watchdog thread): the
    difference is the price of the per-operation timeout. ``isolation="process"`` runs each
    config in a supervised child: the difference is the price of isolation (its start included).
    ``engine="breadth"``: the breadth driver, the same examples and steps per example.
    """
    profile = settings(get_profile("ci"), max_examples=examples)
    steps, seconds, split = 0, 0.0, collections.defaultdict[str, float](float)
    for cfg in CONFORMANCE_CONFIGS:
        report = run_swa_allocator_check(SWATokenToKVPoolAllocator, cfg, settings=profile, impl_name="runtime",
                                         failures_dir=None, op_timeout=op_timeout, isolation=isolation,
                                         seed=0 if engine == "breadth" else None, engine=engine)
        if not report.passed:
            raise HarnessBug(f"benchmark run failed conformance: {report.failure}")
        steps += report.steps
        seconds += report.seconds
        for part, spent in report.split.items():
            split[part] += spent
    return LockstepRate(steps, seconds, dict(split))


def engine_alone_us(examples: int) -> float:
    """Microseconds per step Hypothesis' engine spends on ``swa_allocator``'s rule alphabet alone: a state machine
    with the suite's rules on each conformance config (the same names, each behind a precondition as the suite's are,
    drawing the same argument strategies), its ``misuse`` rule and as many per-step invariants, every body and
    precondition doing nothing, run under the profile :func:`lockstep_rate` runs. A floor for the default mode's
    driver: the suite's rules draw more inside their bodies (``data.draw``), and its preconditions and bodies cost
    something."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

    from kvproof.conformance.check import get_suite

    suite = get_suite(Component.SWA_ALLOCATOR).machine
    profile = settings(get_profile("ci"), max_examples=examples)
    steps, seconds = 0, 0.0

    def step(self: Any, **kwargs: Any) -> None:
        nonlocal steps
        steps += 1

    def empty(self: Any) -> None:
        return None

    for cfg in CONFORMANCE_CONFIGS:
        strategies = {name: dict(op.strategies) for name, op in suite.operations.items() if op.on_config(cfg)}
        if suite.misuse_cases:
            strategies["misuse"] = {"data": st.data()}
        body = {name: rule(**drawn)(precondition(lambda self: True)(step)) for name, drawn in strategies.items()}
        body |= {name: invariant()(empty) for name in suite.checks}
        machine = type(f"EngineAlone_{cfg.label()}", (RuleBasedStateMachine,), body)
        start = time.perf_counter()
        run_state_machine_as_test(machine, settings=profile)
        seconds += time.perf_counter() - start
    return seconds / steps * 1e6


def _fastest(examples: int, rounds: int, **variants: dict[str, Any]) -> dict[str, LockstepRate]:
    """:func:`lockstep_rate` of each variant (its keyword arguments) on one core (one torch thread): ``rounds``
    alternating runs of every variant, the fastest of each kept (a shared machine's noise only ever slows a run down,
    and alternating exposes every variant to it alike), so a ratio of two of them is not one noisy run's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [{name: lockstep_rate(examples, **kwargs) for name, kwargs in variants.items()} for _ in range(rounds)]
    finally:
        torch.set_num_threads(threads)
    return {name: max((r[name] for r in runs), key=lambda r: r.per_second) for name in variants}


def fuzz_steps_per_second(workers: int, seconds: float, engine: str = DEFAULT_ENGINE) -> tuple[float, int]:
    """A ``kvproof fuzz`` campaign over the ``swa_allocator`` slices for ``seconds`` on ``workers`` processes, in a
    scratch directory (its ledger, database and failure files go there): lockstep steps per second of wall-clock
    time (worker start and wind-down included) and the steps."""
    from kvproof.conformance.fuzz import Budget, Campaign, plan_campaign
    from kvproof.conformance.plan import load_impls, plan

    tests = plan((Component.SWA_ALLOCATOR,), load_impls(()), (), None, {}).tests
    with tempfile.TemporaryDirectory(prefix="kvproof-bench-") as scratch, contextlib.chdir(scratch):
        spec = plan_campaign(tests, Budget(seconds=seconds), workers=workers, seed=0, engine=engine, fresh=True,
                             db=os.path.join(scratch, "db"))
        campaign = Campaign(spec)
        campaign.run()
    if campaign.failures or campaign.errors:
        raise HarnessBug(f"benchmark campaign failed: {[f.diagnosis for f in campaign.failures] + campaign.errors}")
    return campaign.total_steps / campaign.elapsed, campaign.total_steps


def isolation_start_ms(repeat: int) -> float:
    """Milliseconds to start a supervised child, hand back a small result and reap it (once per config)."""
    from kvproof.conformance.isolation import run_isolated

    run_isolated(lambda: 0, op_timeout=None)  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        run_isolated(lambda: 0, op_timeout=None)
    return (time.perf_counter() - start) / repeat * 1e3


def translate_cost_us(numel: int, calls: int) -> tuple[float, float]:
    """Microseconds per ``translate_loc_from_full_to_swa`` call of ``numel`` slots: cache hit, cache miss.

    A miss is measured as an invalidation followed by the translation (what a forward's
    first SWA layer pays); a hit is the same tensor translated again (every later layer).
    """
    cfg = _bench_config(4)
    alloc = SWATokenToKVPoolAllocator(cfg)
    pool, dev = alloc.get_kvcache(), alloc.device
    loc = torch.arange(cfg.page_size, cfg.page_size + numel, dtype=torch.int64, device=dev)
    pool.translate_loc_from_full_to_swa(loc)
    timings = []
    for invalidate in (False, True):
        _sync(dev)
        start = time.perf_counter()
        for _ in range(calls):
            if invalidate:
                pool.invalidate_loc_cache()
            pool.translate_loc_from_full_to_swa(loc)
        _sync(dev)
        timings.append((time.perf_counter() - start) / calls * 1e6)
    return timings[0], timings[1]


#: (W, P, prompt tokens, full pool tokens, SWA pool tokens); the first row is §2.10's case.
CAPACITY_SETTINGS: tuple[tuple[int, int, int, int, int], ...] = (
    (128, 64, 8192, 99_968, 9_984),
    (128, 64, 2048, 99_968, 9_984),
    (128, 256, 8192, 99_840, 9_984),
    (4096, 64, 8192, 99_968, 39_936),
    (512, 16, 32_768, 399_984, 19_984),
)


def decode_capacity(window: int, page: int, prompt: int, full: int, swa: int, *, tail: bool) -> int:
    """Requests one admission round preallocates on an empty decode node (R = 512, corrected policy)."""
    from kvproof.reference import decode_prealloc as dp

    pool = PoolConfig(size_full=full, size_swa=swa, page_size=page, sliding_window_size=window)
    node = dp.initial_node(dp.DecodeConfig(policy=dp.PreallocPolicy.CORRECTED, swa_tail_prealloc=tail,
                                           write_kv=False))
    for rid in range(1, full // prompt + 2):
        node = dp.arrive(node, rid, prompt, 1, 128)
    result = dp.pop_preallocated(node, ref.initial_state(pool))
    if result.crash is not None:
        raise HarnessBug(f"capacity study crashed: {result.crash}")
    return len(result.rids)


def capacity_table() -> Table:
    table = Table(title="decode_prealloc capacity: requests admitted in one round (R=512, max_new_tokens=128)")
    for col in ("W", "P", "prompt", "full pool", "SWA pool", "full-length SWA", "tail SWA", "gain"):
        table.add_column(col, justify="right")
    for w, p, prompt, full, swa in CAPACITY_SETTINGS:
        before = decode_capacity(w, p, prompt, full, swa, tail=False)
        after = decode_capacity(w, p, prompt, full, swa, tail=True)
        gain = f"{after / before:.1f}x" if before else "inf"
        table.add_row(*(f"{x:,}" for x in (w, p, prompt, full, swa, before, after)), gain)
    return table


#: (W, P, host tombstone tokens, SWA pool pages, tokens each request extends the tombstone by) of the admission
#: table: S8's numbers, S9's, a window-long tombstone, a small page
ADMISSION_SETTINGS = ((128, 64, 192, 10, 768), (128, 64, 4096, 32, 256), (4096, 64, 4096, 160, 256),
                      (128, 16, 64, 40, 256))
#: requests of a round in the admission table and benchmark
ADMISSION_EXTEND, ADMISSION_MAX_NEW, ADMISSION_CHUNK, ADMISSION_REQUESTS = 256, 128, 512, 8


def _admission_setup(w: int, p: int, tombstone: int, pages: int, policy: ad.AdmissionPolicy) -> ad.AdmissionSetup:
    """A tombstone under a one-page device prefix (S8/S9's tree), the requests' shared prefix."""
    config = ad.AdmissionConfig(page_size=p, sliding_window=w, swa_pages=pages, chunk_size=ADMISSION_CHUNK,
                                policy=policy)
    nodes = (ad.Node(parent=-1, length=p, full_on_device=True, swa=ad.SwaValue.DEVICE),
             ad.Node(parent=0, length=tombstone, full_on_device=True, swa=ad.SwaValue.HOST))
    return ad.AdmissionSetup(name="bench", config=config, nodes=nodes)


def _reference_round(state: ad.AdmissionState, rids: list[int]) -> tuple[ad.AdmissionState, int]:
    """One round on the reference: match and add in order until the adder stops; the batch allocates."""
    state, admitted = ad.get_new_batch_prefill(state), 0
    for rid in rids:
        state = ad.match_prefix_for_req(state, rid)
        state, result = ad.add_one_req(state, rid)
        admitted += state.requests[rid].status is ad.ReqStatus.ADMITTED
        if state.requests[rid].status is ad.ReqStatus.WAITING or result is not ad.AddReqResult.CONTINUE:
            break
    return ad.prepare_for_extend(state), admitted


def admission_round_table() -> Table:
    """How many of 8 requests over a host tombstone one round admits, per policy (reference)."""
    table = Table(title=f"admission: requests one round admits ({ADMISSION_REQUESTS} waiting over a host tombstone, "
                        f"chunk {ADMISSION_CHUNK}; OOM: admitted, then out of SWA memory)")
    for col in ("W", "P", "tombstone", "SWA pages", "extend", *(pol.value for pol in ad.AdmissionPolicy)):
        table.add_column(col, justify="right")
    for w, p, tombstone, pages, extend in ADMISSION_SETTINGS:
        cells = []
        for policy in ad.AdmissionPolicy:
            setup = _admission_setup(w, p, tombstone, pages, policy)
            state = ad.initial_state(setup.config, setup.nodes)
            prompt = p + tombstone + extend
            for _ in range(ADMISSION_REQUESTS):
                state, _ = ad.arrive(state, prompt, ADMISSION_MAX_NEW, 1)
            try:
                cells.append(str(_reference_round(state, list(range(ADMISSION_REQUESTS)))[1]))
            except OutOfMemory:
                cells.append("OOM")
        table.add_row(*(f"{x:,}" for x in (w, p, tombstone, pages, extend)), *cells)
    return table


def admission_decisions_per_second(kind: str, rounds: int) -> float:
    """``add_one_req`` decisions per second (``runtime`` or ``reference``), ``corrected``, S9's tree in a pool
    that serves several requests a round: rounds of 8 arrivals, each matched and added, allocated, finished."""
    setup = _admission_setup(128, 64, 4096, 256, ad.AdmissionPolicy.CORRECTED)
    prompt, decisions = 64 + 4096 + ADMISSION_EXTEND, 0
    if kind == "reference":
        state = ad.initial_state(setup.config, setup.nodes)
        start = time.perf_counter()
        for _ in range(rounds):
            first = len(state.requests)
            for _ in range(ADMISSION_REQUESTS):
                state, _ = ad.arrive(state, prompt, ADMISSION_MAX_NEW, 1)
            state = ad.get_new_batch_prefill(state)
            for rid in range(first, first + ADMISSION_REQUESTS):
                state = ad.match_prefix_for_req(state, rid)
                state, _ = ad.add_one_req(state, rid)
                decisions += 1
            state = ad.prepare_for_extend(state)
            for rid in range(first, first + ADMISSION_REQUESTS):
                if state.requests[rid].status is ad.ReqStatus.RUNNING:
                    state = ad.cache_finished_req(state, rid)
        return decisions / (time.perf_counter() - start)
    rt = AdmissionRuntime(setup)
    _sync(rt.device)
    start = time.perf_counter()
    for _ in range(rounds):
        rids = [rt.arrive(prompt, ADMISSION_MAX_NEW, 1) for _ in range(ADMISSION_REQUESTS)]
        rt.get_new_batch_prefill()
        for rid in rids:
            rt.match_prefix_for_req(rid)
            rt.add_one_req(rid)
            decisions += 1
        running = list(rt.adder.can_run) if rt.adder is not None else []
        rt.prepare_for_extend()
        for rid in running:
            rt.cache_finished_req(rid)
    _sync(rt.device)
    return decisions / (time.perf_counter() - start)


def host_backup_tokens_per_second(kind: str, batch: int, steps: int) -> float:
    """Eager backups per second: ``batch`` requests staged with 1..P_h tokens, then ``steps`` decode steps.

    ``kind``: ``runtime`` (one vectorised call per step), ``runtime_one_by_one`` (one call
    per request), ``reference`` (the pure reference, one call per step).
    """
    p = 64
    config = hh.HostPoolConfig(page_size=p, num_pages=batch * (2 + steps // p + 1), max_req_slots=batch,
                               max_context_len=p * (steps // p + 4))
    rng = random.Random(1)
    prefill = [rng.randint(1, p) for _ in range(batch)]
    reqs = list(range(batch))
    if kind == "reference":
        state = hh.initial_state(config)
        for r in reqs:
            state, _ = hh.admit_request_into_staging(state, r, list(range(prefill[r])))
        start = time.perf_counter()
        for step in range(steps):
            state, _ = hh.eager_backup_previous_token(state, reqs, [n + 1 + step for n in prefill], reqs)
        return batch * steps / (time.perf_counter() - start)
    pool = HiSparseHostPool(config)
    for r in reqs:
        pool.admit_request_into_staging(r, torch.arange(prefill[r]))
    lens = torch.tensor(prefill) + 1
    values = torch.arange(batch)
    _sync(pool.device)
    start = time.perf_counter()
    for step in range(steps):
        if kind == "runtime":
            pool.eager_backup_previous_token(reqs, lens + step, values)
        else:
            for r in reqs:
                pool.eager_backup_previous_token([r], [prefill[r] + 1 + step], [r])
    _sync(pool.device)
    return batch * steps / (time.perf_counter() - start)


def _sglang_rows(rows: dict[str, str], quick: bool) -> str:
    """kvproof's runtime vs SGLang 0.5.23's allocator on one operation sequence (when SGLang is installed)."""
    from kvproof.conformance.adapters.sglang import sglang_available

    if not sglang_available():
        return ("SGLang not installed here: the side-by-side rows are not measured "
                "(make sglang; .venv-sglang/bin/kvproof bench)")
    from kvproof.conformance.adapters.bench_sglang import side_by_side

    for r in side_by_side(page_sizes=(1, 4), ops=2000 if quick else 10_000, repeat=1 if quick else 3):
        rows[f"{r['op']}+free ops/s, P={r['page_size']}: kvproof runtime / SGLang 0.5.23"] = (
            f"{r['kvproof_ops_per_s']:,.0f} / {r['sglang_ops_per_s']:,.0f} = {r['ratio']:.2f}x")
    return ""


def _sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Section:
    """One component's part of the benchmark: table rows, extra tables, and the numbers returned."""

    rows: dict[str, str] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _swa_allocator(quick: bool) -> Section:
    pairs, examples = (500, 10) if quick else (5000, 40)
    p1, _ = runtime_pairs_per_second(1, pairs)
    p4, _ = runtime_pairs_per_second(4, pairs)
    r4 = reference_pairs_per_second(4, max(200, pairs // 10))
    rates = _fastest(examples, 1 if quick else 3, default={}, breadth={"engine": "breadth"},
                     direct={"op_timeout": None}, isolated={"isolation": "process"})
    default, breadth = rates["default"], rates["breadth"]
    direct_steps_per_s, isolated_steps_per_s = rates["direct"].per_second, rates["isolated"].per_second
    (steps_per_s, steps), (breadth_per_s, breadth_steps) = (default.per_second, default.steps), (
        breadth.per_second, breadth.steps)
    floor = sum(breadth.micros(part) for part in ("implementation", "reference", "checks"))
    engine = min(engine_alone_us(examples) for _ in range(1 if quick else 3))  # the fastest: a floor
    ceiling = 1e6 / (engine + sum(default.micros(part) for part in ("implementation", "reference", "checks")))
    cores = os.cpu_count() or 1
    fuzz_s = 8.0 if quick else 30.0
    fuzz_one, _ = fuzz_steps_per_second(1, fuzz_s)
    fuzz_all, _ = fuzz_steps_per_second(cores, fuzz_s)
    fuzz_breadth, _ = fuzz_steps_per_second(1, fuzz_s, engine="breadth")
    start_ms = isolation_start_ms(5 if quick else 20)
    overhead = (1.0 / steps_per_s) / (1.0 / (2 * p4))  # one lockstep step / one bare op (half an extend+free pair)
    out = Section(rows={
        "runtime alloc_extend+free pairs/s, P=1": f"{p1:,.0f}",
        "runtime alloc_extend+free pairs/s, P=4": f"{p4:,.0f}",
        "reference alloc_extend+free pairs/s, P=4": f"{r4:,.0f}",
        "runtime / reference speed, P=4": f"{p4 / r4:.1f}x",
        f"lockstep steps/s (swa_allocator, {steps} steps)": f"{steps_per_s:,.0f}",
        "harness overhead: lockstep step / bare runtime op": f"{overhead:.1f}x",
        f"lockstep steps/s, breadth mode (swa_allocator, {breadth_steps} steps)": f"{breadth_per_s:,.0f}",
        "breadth / hypothesis mode steps/s (one core)": f"{breadth_per_s / steps_per_s:.2f}x",
        **{f"us per step, {mode}: implementation / reference / checks / driver": " / ".join(
            f"{rate.micros(part):.0f}" for part in ("implementation", "reference", "checks", "driver"))
           for mode, rate in (("hypothesis mode", default), ("breadth mode", breadth))},
        "breadth / hypothesis bound with a driver costing nothing (hypothesis step / the three parts)":
            f"{1e6 / steps_per_s / floor:.2f}x",
        "us per step, Hypothesis' engine alone on the suite's rules (empty rules and checks: a floor)":
            f"{engine:.0f}",
        "hypothesis mode ceiling, steps/s: that floor + implementation + reference + checks, no harness":
            f"{ceiling:,.0f}",
        f"kvproof fuzz steps/s, 1 worker / {cores} workers ({fuzz_s:g} s each)": f"{fuzz_one:,.0f} / {fuzz_all:,.0f}",
        f"kvproof fuzz {cores} workers / 1 worker (ideal {cores}x)": f"{fuzz_all / fuzz_one:.2f}x",
        "kvproof fuzz --mode breadth steps/s, 1 worker (a campaign: process-isolated, saved failures)":
            f"{fuzz_breadth:,.0f}",
        "kvproof fuzz --mode breadth / hypothesis, 1 worker": f"{fuzz_breadth / fuzz_one:.2f}x",
        "lockstep steps/s without the per-op watchdog / with it": f"{direct_steps_per_s / steps_per_s:.2f}x",
        "lockstep steps/s process-isolated (one child per config)": f"{isolated_steps_per_s:,.0f}",
        "lockstep steps/s in-process / process-isolated": f"{steps_per_s / isolated_steps_per_s:.2f}x",
        "isolation start per config: fork + result + reap (ms)": f"{start_ms:.1f}",
    }, values={"pairs_p1": p1, "pairs_p4": p4, "ref_pairs_p4": r4, "steps_per_s": steps_per_s, "overhead": overhead,
               "breadth_steps_per_s": breadth_per_s, "breadth_vs_hypothesis": breadth_per_s / steps_per_s,
               "breadth_bound": 1e6 / steps_per_s / floor,
               "engine_alone_us": engine, "hypothesis_ceiling": ceiling,
               **{f"{mode}_us_{part}": rate.micros(part) for mode, rate in (("hypothesis", default),
                                                                            ("breadth", breadth))
                  for part in ("implementation", "reference", "checks", "driver")},
               "fuzz_one_worker_steps_per_s": fuzz_one, "fuzz_all_workers_steps_per_s": fuzz_all,
               "fuzz_scaling": fuzz_all / fuzz_one, "fuzz_breadth_steps_per_s": fuzz_breadth,
               "fuzz_breadth_vs_hypothesis": fuzz_breadth / fuzz_one,
               "watchdog_cost": direct_steps_per_s / steps_per_s, "isolated_steps_per_s": isolated_steps_per_s,
               "isolation_cost": steps_per_s / isolated_steps_per_s, "isolation_start_ms": start_ms})
    note = _sglang_rows(out.rows, quick)
    if note:
        out.notes.append(note)
    return out


def _loc_cache(quick: bool) -> Section:
    calls = 500 if quick else 5000
    hit64, miss64 = translate_cost_us(64, calls)
    hit4k, miss4k = translate_cost_us(4096, calls)
    return Section(rows={
        "loc_cache translate, 64 slots: hit / miss (us)": f"{hit64:.2f} / {miss64:.2f}",
        "loc_cache translate, 4096 slots: hit / miss (us)": f"{hit4k:.2f} / {miss4k:.2f}",
        "loc_cache miss / hit, 4096 slots": f"{miss4k / hit4k:.1f}x",
    }, values={"translate_hit_us": hit4k, "translate_miss_us": miss4k})


def _decode_prealloc(quick: bool) -> Section:
    return Section(tables=[capacity_table()])


def _hisparse_host(quick: bool) -> Section:
    host_steps = 30 if quick else 200
    host_vec = host_backup_tokens_per_second("runtime", 64, host_steps)
    host_one = host_backup_tokens_per_second("runtime_one_by_one", 64, host_steps)
    host_ref = host_backup_tokens_per_second("reference", 64, max(10, host_steps // 10))
    return Section(rows={
        "hisparse_host eager backup tokens/s, 64 requests, P_h=64 (runtime, batched)": f"{host_vec:,.0f}",
        "hisparse_host backup: batched / one request per call (runtime)": f"{host_vec / host_one:.1f}x",
        "hisparse_host backup: runtime batched / reference": f"{host_vec / host_ref:.1f}x",
    }, values={"host_backup_tokens_per_s": host_vec, "host_backup_batched_vs_one": host_vec / host_one,
               "host_backup_vs_reference": host_vec / host_ref})


def _admission(quick: bool) -> Section:
    rounds = 5 if quick else 40
    runtime = admission_decisions_per_second("runtime", rounds)
    reference = admission_decisions_per_second("reference", rounds)
    return Section(rows={
        "admission add_one_req decisions/s, corrected, 8 per round (runtime)": f"{runtime:,.0f}",
        "admission add_one_req decisions/s (reference)": f"{reference:,.0f}",
    }, values={"admission_decisions_per_s": runtime, "admission_reference_decisions_per_s": reference},
        tables=[admission_round_table()])


def tp_prefetch_sync_ms(world_size: int, prefetches: int) -> tuple[float, float, float]:
    """One prefetch on a group of ``world_size`` rank processes (gloo on loopback): milliseconds for its storage-hit
    sync alone (one all-reduce, the command round trip included) and for the whole check (five operations, three
    to five all-reduces, the commit), per prefetch; and the seconds the group took to start."""
    from kvproof.gpu_runtime import _ranks
    from kvproof.gpu_runtime.tp_prefetch import TPPrefetchRuntime
    from kvproof.reference import tp_prefetch as tp

    group = tp.TPPrefetchGroup(name="bench", world_size=world_size, page_size=4, sliding_window=8,
                               max_request_pages=8, existing=())
    start = time.perf_counter()
    runtime = TPPrefetchRuntime(group)
    started = time.perf_counter() - start
    ranks = [tp.RankProgress(storage_hit=8, full_pages=8)] * world_size
    sync, whole = 0.0, 0.0
    for _ in range(prefetches):
        runtime = TPPrefetchRuntime(group)  # a fresh host side on the warm group
        t0 = time.perf_counter()
        runtime.initial_state(8, ranks)
        t1 = time.perf_counter()
        runtime.sync_prefetch_hit_query()
        t2 = time.perf_counter()
        for op in ("page_transfer", "can_terminate_prefetch", "reduce_prefetch_ack", "handle_prefetch_result"):
            getattr(runtime, op)()
        t3 = time.perf_counter()
        sync += t2 - t1
        whole += t3 - t0
    _ranks.release_all()
    return sync / prefetches * 1e3, whole / prefetches * 1e3, started


def tp_prefetch_lockstep_per_second(examples: int) -> tuple[float, float]:
    """Checked prefetches (committed or waiting checks) and lockstep steps per second: the ``tp_prefetch`` suite
    against the multi-process runtime on its two-rank config, in-process, a fixed derandomized profile."""
    from kvproof.conformance.check import run_check
    from kvproof.conformance.tp_prefetch import TP_CONFIGS
    from kvproof.gpu_runtime import _ranks
    from kvproof.gpu_runtime.tp_prefetch import TPPrefetchRuntime

    profile = settings(get_profile("ci"), max_examples=examples)
    report = run_check(Component.TP_PREFETCH, TPPrefetchRuntime, TP_CONFIGS[0], settings=profile,
                       impl_name="runtime", failures_dir=None, isolation="in-process")
    _ranks.release_all()
    if not report.passed:
        raise HarnessBug(f"benchmark run failed conformance: {report.failure}")
    checks = report.calls.get("can_terminate_prefetch", 0)
    return checks / report.seconds, report.steps / report.seconds


def _tp_prefetch(quick: bool) -> Section:
    prefetches, examples = (20, 10) if quick else (200, 40)
    sync2, whole2, start2 = tp_prefetch_sync_ms(2, prefetches)
    sync4, whole4, start4 = tp_prefetch_sync_ms(4, prefetches)
    checks_per_s, steps_per_s = tp_prefetch_lockstep_per_second(examples)
    return Section(rows={
        "tp_prefetch hit sync per prefetch, 2 / 4 ranks (ms)": f"{sync2:.2f} / {sync4:.2f}",
        "tp_prefetch whole check per prefetch, 2 / 4 ranks (ms)": f"{whole2:.2f} / {whole4:.2f}",
        "tp_prefetch check, 4 ranks / 2 ranks": f"{whole4 / whole2:.2f}x",
        "tp_prefetch group start, 2 / 4 ranks (s)": f"{start2:.1f} / {start4:.1f}",
        "tp_prefetch lockstep prefetches/s (2 ranks, checks reaching the vote)": f"{checks_per_s:,.1f}",
        "tp_prefetch lockstep steps/s (2 ranks)": f"{steps_per_s:,.1f}",
    }, values={"tp_sync_ms_2": sync2, "tp_sync_ms_4": sync4, "tp_check_ms_2": whole2, "tp_check_ms_4": whole4,
               "tp_lockstep_prefetches_per_s": checks_per_s, "tp_lockstep_steps_per_s": steps_per_s})


def block_pool_steps_per_second(kind: str, steps: int) -> float:
    """Scheduler steps per second of the ``block_pool`` manager (``kind``: ``runtime`` or ``reference``) on one seeded
    sequence: admit a request (prompt a prefix of one of four base sequences: hits) with its lookup, prefill it in
    chunks of up to 16 tokens, decode, release what left the window, finish; 2048 blocks of 16 tokens, window 64."""
    from kvproof.conformance.reference_impl import ReferenceBlockPool
    from kvproof.reference import block_pool as bp

    config = bp.BlockPoolConfig(block_size=16, num_blocks=2048, sliding_window=64, max_model_len=1024)
    if kind == "runtime":
        from kvproof.gpu_runtime.block_pool import BlockPoolRuntime

        impl: Any = BlockPoolRuntime(config)
    else:
        impl = ReferenceBlockPool(config)
    rng = random.Random(7)
    bases = [[rng.randrange(30_000) for _ in range(1024)] for _ in range(4)]
    running: dict[int, list[Any]] = {}  # rid -> [tokens, computed, decodes left]
    rid = 0
    start = time.perf_counter()
    for _ in range(steps):
        if len(running) < 16:
            rid += 1
            tokens = bases[rng.randrange(4)][:rng.randint(16, 256)]
            hit = impl.get_computed_blocks(tokens)
            chunk = min(16, len(tokens) - hit.num_tokens)
            impl.allocate_slots(rid, tokens, 0, chunk, hit, True)
            running[rid] = [tokens, hit.num_tokens + chunk, rng.randint(1, 64)]
            continue
        r = rng.choice(sorted(running))
        tokens, computed, left = running[r]
        if computed == len(tokens):
            if not left:
                impl.free(r)
                del running[r]
                continue
            tokens = [*tokens, rng.randrange(30_000)]
            left -= 1
        n = min(16, len(tokens) - computed)
        impl.remove_skipped_blocks(r, computed)
        impl.allocate_slots(r, tokens, computed, n)
        running[r] = [tokens, computed + n, left]
    return steps / (time.perf_counter() - start)


def _block_pool(quick: bool) -> Section:
    from kvproof.conformance.block_pool import BLOCK_POOL_CONFIGS
    from kvproof.conformance.check import run_check
    from kvproof.conformance.plan import load_factory
    from kvproof.reference.registry import info

    steps = 300 if quick else 3000
    runtime = block_pool_steps_per_second("runtime", steps)
    reference = block_pool_steps_per_second("reference", steps)
    rows = {"block_pool scheduler steps/s, B=16, 2048 blocks, W=64 (runtime)": f"{runtime:,.0f}",
            "block_pool scheduler steps/s (reference)": f"{reference:,.0f}",
            "block_pool runtime / reference": f"{runtime / reference:.2f}x"}
    values = {"block_pool_steps_per_s": runtime, "block_pool_reference_steps_per_s": reference,
              "block_pool_vs_reference": runtime / reference}
    profile = settings(get_profile("ci"), max_examples=10 if quick else 40)
    factory = load_factory(info(Component.BLOCK_POOL).default_impl)
    report = run_check(Component.BLOCK_POOL, factory, BLOCK_POOL_CONFIGS[2], settings=profile, failures_dir=None)
    if not report.passed:
        raise HarnessBug(f"benchmark run failed conformance: {report.failure}")
    lockstep = report.steps / report.seconds
    rows["block_pool lockstep steps/s (default implementation, one config)"] = f"{lockstep:,.0f}"
    values["block_pool_lockstep_steps_per_s"] = lockstep
    return Section(rows=rows, values=values)


#: The benchmark's sections, one per component of the registry (``tests/test_registry.py`` checks the keys).
SECTIONS: dict[Component, Callable[[bool], Section]] = {
    Component.SWA_ALLOCATOR: _swa_allocator,
    Component.LOC_CACHE: _loc_cache,
    Component.DECODE_PREALLOC: _decode_prealloc,
    Component.HISPARSE_HOST: _hisparse_host,
    Component.ADMISSION: _admission,
    Component.TP_PREFETCH: _tp_prefetch,
    Component.BLOCK_POOL: _block_pool,
}


def run_bench(console: Console, *, quick: bool = False, components: Iterable[Component | str] = ()
              ) -> dict[str, float]:
    """Every selected component's section (default: all), measured in this one run; the numbers, by name."""
    chosen = parse_components(components) or tuple(Component)
    sections = [SECTIONS[c](quick) for c in chosen]
    device = default_device()
    table = Table(title=f"kvproof bench (runtime device: {device}, torch {torch.__version__})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    values: dict[str, float] = {}
    for section in sections:
        for k, v in section.rows.items():
            table.add_row(k, v)
        values.update(section.values)
    if table.row_count:
        console.print(table)
    for section in sections:
        for note in section.notes:
            console.print(note)
        for extra in section.tables:
            console.print(extra)
    return values

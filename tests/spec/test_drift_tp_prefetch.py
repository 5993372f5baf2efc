"""tp_prefetch drift: every transition of the Z3 models accepts the steps the reference takes, under each variant.

Seeded reference checks of ``kvproof.reference.tp_prefetch`` (1 to 8 ranks with their own storage hits, Full
progress, IO state, deadlines, policies, transfer sets, failing SWA pages and, in 0.5.23, Full host pages free at hit
time, over host paths of up to two nodes; sglang_semantics.md §6) run every operation, through 0.5.23's revokes (a
synced hit of 0) and its checks that reduce no ACK while an IO thread is in flight. Each step is abstracted into the
model's state (:class:`kvproof.spec.tp_prefetch.State`: the constants, each rank's inputs, and what each operation
derived for it) and checked against the transition of the same name in the variant's system with concrete values; a
call the reference rejects (an operation out of order, or after a revoke) has no successor in the model. Deliberately
wrong transitions (a MAX for the MIN, no hit sync, the sidecars fetched before the Full pages, a partial window
attached, another variant's reduction, 0.5.23 staged before the hit, its ACKs reduced while an IO thread is in flight)
reject sampled steps, so these checks can fail.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import z3

from kvproof.reference import tp_prefetch as tp
from kvproof.reference.errors import InvalidOperation
from kvproof.spec import _ts
from kvproof.spec import tp_prefetch as spec

V = tp.TPPrefetchVariant
Pool = tp.PoolName
RUNS = 200
Values = dict[str, Any]
Pins = list[tuple[z3.ExprRef, z3.ExprRef]]
POLICY = {tp.TerminationPolicy.BEST_EFFORT: spec.BE, tp.TerminationPolicy.WAIT_COMPLETE: spec.WC,
          tp.TerminationPolicy.TIMEOUT: spec.TO}
PHASE = {p: spec.PHASES.index(p.value) for p in tp.Phase}
MISMATCH = {name: code for code, name in enumerate(spec.COLLECTIVES) if name}
STEPS: tuple[tuple[str, Callable[[tp.PrefetchState], tp.PrefetchState]], ...] = (
    ("sync_prefetch_hit_query", tp.sync_prefetch_hit_query), ("page_transfer", tp.page_transfer),
    ("can_terminate_prefetch", tp.can_terminate_prefetch), ("reduce_prefetch_ack", tp.reduce_prefetch_ack),
    ("handle_prefetch_result", tp.handle_prefetch_result))


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reference step as the model sees it."""

    variant: V
    op: str
    pre: Values
    action: Values
    post: Values


# ---- abstraction ----------------------------------------------------------------------------------------------


def _slots(values: list[Any], default: Any) -> tuple[Any, ...]:
    return tuple(values) + (default,) * (spec.RANKS - len(values))


def abstract(state: tp.PrefetchState) -> Values:
    """The reference state in the model's terms (pages; inactive rank slots at their defaults)."""
    c, p = state.config, state.config.page_size
    nodes = [*c.existing, tp.HostNode(length=p), tp.HostNode(length=p)][:2]
    e = [n.length // p if i < len(c.existing) else 0 for i, n in enumerate(nodes)]
    out: Values = {"P": p, "sw": c.sw_pages, "R": c.request_pages, "N": state.world_size, "root": c.anchor_is_root,
                   "e1": e[0], "e2": e[1], "s1": len(c.existing) > 0 and c.existing[0].swa_host,
                   "s2": len(c.existing) > 1 and c.existing[1].swa_host}
    ranks = [r.progress for r in state.ranks]
    windows = [tp.window_pages(c, q) for q in ranks]
    out |= {"hit": _slots([q.storage_hit for q in ranks], 0), "full": _slots([q.full_pages for q in ranks], 0),
            "done": _slots([q.io_done for q in ranks], True), "dl": _slots([q.deadline_passed for q in ranks], False),
            "pol": _slots([POLICY[q.policy] for q in ranks], spec.WC),
            "swa": _slots([Pool.SWA in q.transfers for q in ranks], False),
            "mamba": _slots([Pool.MAMBA in q.transfers for q in ranks], False),
            "first_miss": _slots([min((*q.swa_missing, n)) for q, n in zip(ranks, windows, strict=True)], 0),
            "mamba_ok": _slots([not q.mamba_missing for q in ranks], True),
            "reg": _slots([q.registered for q in ranks], True),
            "hfree": _slots([q.host_free_pages or 0 for q in ranks], 0)}
    out |= {"phase": PHASE[state.phase], "mism": MISMATCH[state.mismatch.name] if state.mismatch else 0,
            "mix": any(call.mixed for call in state.collectives if call.name == "reduce_prefetch_ack")}

    def per_rank(field: str, read: Callable[[tp.RankState], Any], default: Any) -> None:
        out[field] = _slots([read(r) for r in state.ranks], default)

    def commit(read: Callable[[tp.RankCommit], Any], default: Any) -> Callable[[tp.RankState], Any]:
        return lambda r: default if r.commit is None else read(r.commit)

    def io(read: Callable[[tp.IOResult], Any], default: Any) -> Callable[[tp.RankState], Any]:
        return lambda r: default if r.io is None else read(r.io)

    per_rank("H", lambda r: r.synced_hit or 0, 0)
    per_rank("staged", lambda r: r.staged or 0, 0)
    per_rank("window", lambda r: r.window or 0, 0)
    per_rank("C", io(lambda i: i.completed, 0), 0)
    per_rank("reach", io(lambda i: i.reached_sidecars, False), False)
    per_rank("cnt", io(lambda i: i.hits.get(Pool.SWA, 0), 0), 0)
    per_rank("mcnt", io(lambda i: i.hits.get(Pool.MAMBA, 0), 0), 0)
    per_rank("infl", io(lambda i: bool(i.in_flight), False), False)
    per_rank("fin", io(lambda i: i.finished, False), False)
    per_rank("go", lambda r: bool(r.proceeds), False)
    per_rank("M", lambda r: r.min_completed or 0, 0)
    per_rank("S", lambda r: (r.synced_hits or {}).get(Pool.SWA, 0), 0)
    per_rank("Sm", lambda r: (r.synced_hits or {}).get(Pool.MAMBA, 0), 0)
    per_rank("tdone", lambda r: r.transfers_done, False)
    per_rank("total", commit(lambda k: k.total_len // p, 0), 0)
    per_rank("attach", commit(lambda k: k.attached, False), False)
    per_rank("disc", commit(lambda k: k.discarded, False), False)
    per_rank("hazard", commit(lambda k: bool(k.written_after_release), False), False)
    per_rank("prefix", commit(lambda k: k.prefix_len // p, 0), 0)
    per_rank("ins_split", commit(lambda k: -1 if k.insert_split is None else k.insert_split // p, -1), -1)
    per_rank("swa_split", commit(lambda k: -1 if k.swa_split is None else k.swa_split // p, -1), -1)
    return out


def successes(state: tp.PrefetchState) -> Values:
    """``page_transfer``'s action: each rank's successful SWA fetches among its ``min(window buffer, target)`` keys."""
    out = []
    for r in state.ranks:
        k = min(r.window or 0, r.synced_hit or 0, r.staged or 0)
        out.append(sum(1 for i in range(k) if i not in r.progress.swa_missing))
    return {"succ": _slots(out, 0)}


# ---- seeded reference runs ---------------------------------------------------------------------------------------


def random_check(rng: random.Random, variant: V) -> tuple[tp.TPPrefetchConfig, list[tp.RankProgress]]:
    p, sw = rng.choice((1, 2, 4)), rng.randint(1, 3)
    r_pages = rng.randint(1, 7)
    existing, room = [], r_pages
    for _ in range(rng.randint(0, 2)):
        if room:
            length = rng.randint(1, room)
            room -= length
            existing.append(tp.HostNode(length=length * p, swa_host=rng.random() < 0.4))
    root = rng.random() < 0.3
    cfg = tp.TPPrefetchConfig(page_size=p, sliding_window=sw * p - rng.randint(0, p - 1), request_pages=r_pages,
                              anchor_is_root=root, existing=tuple(existing), variant=variant)
    swa_ok = r_pages >= sw or (variant.protocol_0523 and root)
    sets = [(Pool.SWA,), (Pool.SWA, Pool.MAMBA)] if swa_ok else [(Pool.MAMBA,), ()]
    uniform = rng.random() < 0.7
    shared_set = rng.choice(sets + [(Pool.MAMBA,), ()] if rng.random() < 0.2 else sets)
    shared_policy = rng.choice(list(tp.TerminationPolicy))
    ranks = []
    for i in range(rng.choice((1, 2, 2, 3, 4, 8))):
        transfers = shared_set if uniform or rng.random() < 0.6 else rng.choice(sets + [(Pool.MAMBA,), ()])
        n = tp.window_pages(cfg, tp.RankProgress(storage_hit=0, full_pages=0, transfers=transfers))
        ranks.append(tp.RankProgress(
            storage_hit=rng.choice((r_pages, rng.randint(0, r_pages))),
            full_pages=rng.choice((r_pages, r_pages, rng.randint(0, r_pages))), io_done=rng.random() < 0.8,
            deadline_passed=rng.random() < 0.5,
            policy=shared_policy if uniform or rng.random() < 0.7 else rng.choice(list(tp.TerminationPolicy)),
            transfers=transfers, swa_missing=tuple(j for j in range(n) if rng.random() < 0.15),
            mamba_missing=rng.random() < 0.15, registered=i == 0 or rng.random() < 0.97,
            host_free_pages=rng.randint(1, r_pages) if variant.protocol_0523 and rng.random() < 0.25 else None))
    return cfg, ranks


def run_samples(variant: V, cfg: tp.TPPrefetchConfig, ranks: list[tp.RankProgress]) -> list[Sample]:
    state = tp.initial_state(cfg, ranks)
    out = []
    for op, step in STEPS:
        if state.phase in (tp.Phase.MISMATCHED, tp.Phase.WAITING, tp.Phase.REVOKED):
            break
        action = successes(state) if op == "page_transfer" else {}
        post = step(state)
        out.append(Sample(variant, op, abstract(state), action, abstract(post)))
        state = post
    return out


def pinned_checks() -> list[tuple[tp.TPPrefetchConfig, list[tp.RankProgress]]]:
    """Runs random configs rarely reach: S10 (§6.6), its shape case, SWA on one rank and Mamba on the other."""
    s10 = tp.TPPrefetchConfig(page_size=64, sliding_window=128, request_pages=10)
    timeout = tp.TerminationPolicy.TIMEOUT
    s10_ranks = [tp.RankProgress(storage_hit=10, full_pages=10, policy=timeout),
                 tp.RankProgress(storage_hit=10, full_pages=7, io_done=False, deadline_passed=True, policy=timeout)]
    shape = [tp.RankProgress(storage_hit=10, full_pages=10), tp.RankProgress(storage_hit=10, full_pages=10,
                                                                              transfers=())]
    mixed = [tp.RankProgress(storage_hit=10, full_pages=10), tp.RankProgress(storage_hit=10, full_pages=10,
                                                                              transfers=(Pool.MAMBA,))]
    return [(s10.with_variant(v), s10_ranks) for v in V] + [(s10.with_variant(v), shape) for v in V] + [
        (s10.with_variant(v), mixed) for v in V]


@functools.cache
def samples() -> tuple[Sample, ...]:
    out: list[Sample] = []
    for seed in range(RUNS):
        variant = list(V)[seed % len(V)]
        out += run_samples(variant, *random_check(random.Random(seed), variant))
    for cfg, ranks in pinned_checks():
        out += run_samples(cfg.variant, cfg, ranks)
    return tuple(out)


# ---- encoding concrete values as pins ------------------------------------------------------------------------------


def _v(x: Any) -> z3.ExprRef:
    return z3.BoolVal(x) if isinstance(x, bool) else z3.IntVal(int(x))


def state_pins(s: spec.State, v: Values) -> Pins:
    pins: Pins = []
    for f in dataclasses.fields(s):
        term, value = getattr(s, f.name), v[f.name]
        if isinstance(term, tuple):
            pins += [(t, _v(x)) for t, x in zip(term, value, strict=True)]
        else:
            pins.append((term, _v(value)))
    return pins


def action_pins(a: spec.Action, v: Values) -> Pins:
    return [(t, _v(x)) for t, x in zip(a.succ, v.get("succ", (0,) * spec.RANKS), strict=True)]


def system_of(variant: V) -> _ts.TransitionSystem[spec.State, spec.Action]:
    return spec.SYSTEMS_BY_VARIANT[spec.Variant(variant.value)]


def evaluates(system: _ts.TransitionSystem[spec.State, spec.Action], sample: Sample) -> bool | None:
    return _ts.evaluate(system, sample.op, lambda s: state_pins(s, sample.pre), lambda t: state_pins(t, sample.post),
                        lambda a: action_pins(a, sample.action))


def accepts(system: _ts.TransitionSystem[spec.State, spec.Action], sample: Sample) -> _ts.Acceptance:
    return _ts.accepts_pinned(system, sample.op, lambda s: state_pins(s, sample.pre),
                              lambda t: state_pins(t, sample.post), lambda a: action_pins(a, sample.action))


# ---- the tests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(V))
@pytest.mark.parametrize("op", spec.SYSTEM.ops)
def test_every_sampled_step_is_accepted_by_its_transition(variant: V, op: str) -> None:
    system = system_of(variant)
    steps = [s for s in samples() if s.op == op and s.variant is variant]
    assert len(steps) >= 3, f"only {len(steps)} sampled {op} steps under {variant.value}"
    for sample in steps:
        verdict = accepts(system, sample)
        assert verdict.accepted, f"{verdict}\npre {sample.pre}\naction {sample.action}\npost {sample.post}"


def test_the_samples_cover_every_outcome() -> None:
    """Mismatches at each collective, waits, revokes, commits with attached, split and discarded windows, hazards,
    mixes; 0.5.23's host pressure (a rank stages less than the synced hit) and its best_effort checks that reduce no
    ACK while an IO thread is in flight (D3)."""
    got = Counter()
    for s in samples():
        post, n = s.post, s.post["N"]
        got[spec.PHASES[post["phase"]]] += 1
        got["host pressure"] += any(x < h for x, h in zip(post["staged"][:n], post["H"][:n], strict=True))
        got["D3"] += (s.op == "reduce_prefetch_ack" and s.variant.protocol_0523 and not all(s.pre["fin"][:n])
                      and spec.BE in s.pre["pol"][:n])
        got[f"mism {post['mism']}"] += post["phase"] == spec.MISMATCHED
        got["attach"] += any(post["attach"][: post["N"]])
        got["swa_split"] += any(x >= 0 for x in post["swa_split"][: post["N"]])
        got["ins_split"] += any(x >= 0 for x in post["ins_split"][: post["N"]])
        got["disc"] += any(post["disc"][: post["N"]])
        got["hazard"] += any(post["hazard"][: post["N"]])
        got["mix"] += post["mix"]
        got["8 ranks"] += post["N"] == 8
    for key in ("committed", "waiting", "mismatched", "revoked", "mism 1", "mism 2", "mism 3", "attach", "swa_split",
                "ins_split", "disc", "hazard", "mix", "8 ranks", "host pressure", "D3"):
        assert got[key] > 0, (key, got)


def test_calls_out_of_order_have_no_successor() -> None:
    """The reference refuses an operation at the wrong phase (InvalidOperation); the model has no step there."""
    cfg, ranks = random_check(random.Random(1), V.UPSTREAM_27264)
    state = tp.initial_state(cfg, ranks)
    system = system_of(V.UPSTREAM_27264)
    for op, step in STEPS[1:]:
        with pytest.raises(InvalidOperation):
            step(state)
        pre = abstract(state)
        assert not _ts.has_successor(system, op, lambda s, pre=pre: state_pins(s, pre),
                                     lambda a: action_pins(a, successes(state))), op


def test_nothing_runs_after_a_revoke() -> None:
    """0.5.23 revokes a synced hit of 0 right after the hit query (phase ``revoked``): the reference refuses every
    operation from there, and the model has no step there."""
    cfg = tp.TPPrefetchConfig(page_size=2, sliding_window=4, request_pages=4, variant=V.UPSTREAM_0523)
    ranks = [tp.RankProgress(storage_hit=0, full_pages=0), tp.RankProgress(storage_hit=3, full_pages=3)]
    state = tp.sync_prefetch_hit_query(tp.initial_state(cfg, ranks))
    assert state.phase is tp.Phase.REVOKED
    pre = abstract(state)
    assert pre["phase"] == spec.REVOKED and pre["staged"][:2] == pre["window"][:2] == (0, 0)
    system = system_of(V.UPSTREAM_0523)
    for op, step in STEPS:
        with pytest.raises(InvalidOperation):
            step(state)
        assert not _ts.has_successor(system, op, lambda s: state_pins(s, pre), lambda a: action_pins(a, {})), op


@pytest.mark.parametrize(("variant", "op", "wrong"), [
    (V.UPSTREAM_27264, "reduce_prefetch_ack", spec.system(spec.Variant.UPSTREAM_27264, spec.Twist(max_reduce=True))),
    (V.PRE_27264, "reduce_prefetch_ack", spec.SYSTEMS_BY_VARIANT[spec.Variant.UPSTREAM_27264]),
    (V.UPSTREAM_27264, "sync_prefetch_hit_query",
     spec.system(spec.Variant.UPSTREAM_27264, spec.Twist(no_hit_sync=True))),
    (V.UPSTREAM_27264, "page_transfer", spec.system(spec.Variant.UPSTREAM_27264, spec.Twist(no_full_guard=True))),
    (V.UPSTREAM_27264, "handle_prefetch_result",
     spec.system(spec.Variant.UPSTREAM_27264, spec.Twist(partial_window=True))),
    (V.UPSTREAM_0523, "handle_prefetch_result", spec.SYSTEMS_BY_VARIANT[spec.Variant.BEST_EFFORT_RELEASE]),
    (V.UPSTREAM_0523, "page_transfer", spec.SYSTEMS_BY_VARIANT[spec.Variant.SUM_HITS]),
    (V.UPSTREAM_0523, "can_terminate_prefetch", spec.SYSTEMS_BY_VARIANT[spec.Variant.UPSTREAM_27264]),
    (V.UPSTREAM_0523, "sync_prefetch_hit_query",
     spec.system(spec.Variant.UPSTREAM_0523, spec.Twist(staged_at_start=True))),
    (V.UPSTREAM_0523, "reduce_prefetch_ack", spec.system(spec.Variant.UPSTREAM_0523, spec.Twist(ack_in_flight=True))),
])
def test_a_wrong_transition_rejects_sampled_steps(variant: V, op: str,
                                                  wrong: _ts.TransitionSystem[spec.State, spec.Action]) -> None:
    steps = [s for s in samples() if s.op == op and s.variant is variant]
    rejected = [s for s in steps if evaluates(wrong, s) is False]
    assert rejected, f"the wrong {op} accepts all {len(steps)} sampled {variant.value} steps"
    verdict = accepts(wrong, rejected[0])
    assert verdict.status == "rejected" and verdict.conflict, verdict

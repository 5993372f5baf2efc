"""decode_prealloc drift: every transition of the Z3 model accepts the steps the reference takes.

Seeded reference runs of ``kvproof.reference.decode_prealloc`` (small paged pools, both
policies, three requests: sglang_semantics.md §2) are abstracted step by step into the
model's state (:class:`kvproof.spec.decode_prealloc.State`: per slot the status, request,
eviction mark and the pages the allocator's owner table says it holds; both pools' free
pages; the crash flag), and each (pre, action, post) is checked against the transition of
the same name with concrete values in a fresh Z3 context. Calls the reference rejects must
have no successor in the model. A deliberately wrong transition rejects sampled pairs, so
these checks can fail. (The arithmetic builders' drift tests are in ``test_decode_prealloc.py``.)
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

from kvproof.reference import decode_prealloc as dp
from kvproof.reference import swa_allocator as sa
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation
from kvproof.spec import _ts, obligations, systems
from kvproof.spec import decode_prealloc as spec

SLOTS = 3
SYSTEM = spec.system(SLOTS)
OPS = tuple(SYSTEM.ops)
RUNS, STEPS = 60, 20
ROOM_RUNS = 60

Values = dict[str, int | bool]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reference step as the model sees it; ``post`` is None when the reference rejected the call."""

    op: str
    pre: tuple[Values, tuple[Values, ...]]
    action: Values
    post: tuple[Values, tuple[Values, ...]] | None
    events: tuple[str, ...] = ()


class Tracker:
    """A reference run and the ghost facts the model keeps that the reference forgets.

    Slots are numbered by arrival (``rid`` = slot); the retraction stamps and the clock, and
    the last mark of a finished request, are kept here.
    """

    def __init__(self, rng: random.Random, flavour: str = "mixed") -> None:
        """``flavour``: ``mixed``; ``tight`` (UPSTREAM, SWA pages, reserve and CLIP small: where the unrounded
        decrement crashes, S2); ``long`` (P=2, small window, long outputs: where eviction moves the mark); ``room``
        (no reserve, a large CLIP, long outputs, few SWA pages: where the "can finish" room is larger than the
        reserve, so budgets keeping it refuse resumptions SGLang makes, M1)."""
        long, tight, room = flavour == "long", flavour == "tight", flavour == "room"
        p = 2 if long else rng.choice((2, 3, 4))
        swa_pages = (rng.randint(2, 4) if tight else rng.randint(6, 10) if long else rng.randint(3, 5) if room
                     else rng.randint(3, 8))
        full_pages = rng.randint(max(swa_pages, 12), 20) if long else rng.randint(max(swa_pages, 3), 14)
        self.allocator = sa.initial_state(PoolConfig(size_full=full_pages * p, size_swa=swa_pages * p, page_size=p,
                                                     sliding_window_size=rng.randint(1, 2 if long else 4)))
        config = dp.DecodeConfig(reserved_decode_tokens=0 if tight or room else rng.choice((0, 1) if long
                                                                                           else (0, 1, 2, 4)),
                                 clip_max_new_tokens=rng.randint(8, 12) if room else rng.randint(1, 2 if tight else
                                                                                                 4 if long else 8),
                                 policy=dp.PreallocPolicy.UPSTREAM if tight else rng.choice(list(dp.PreallocPolicy)),
                                 write_kv=False)
        self.flavour = flavour
        # room: two arrivals admitted together, one retracted, then a resume round with the other still running
        self.script = ["arrive", "arrive", "pop_preallocated", "retract", "resume_retracted_reqs"] if room else []
        self.node, self.rng = dp.initial_node(config), rng
        self.arrived = 0
        self.crashed = False
        self.clock = 0
        self.stamp: dict[int, int] = {}
        self.last: dict[int, Values] = {}

    # ---- the abstraction ------------------------------------------------------------------

    def state(self) -> tuple[Values, tuple[Values, ...]]:
        p, alloc = self.allocator.config.page_size, self.allocator
        glob: Values = {"P": p, "W": alloc.config.sliding_window_size, "R": self.node.config.reserved_decode_tokens,
                        "CLIP": self.node.config.clip_max_new_tokens,
                        "corrected": self.node.config.policy is dp.PreallocPolicy.CORRECTED,
                        "full_total": alloc.config.num_pages_full, "swa_total": alloc.config.num_pages_swa,
                        "free_full": sa.full_available_size(alloc) // p, "free_swa": sa.swa_available_size(alloc) // p,
                        "crashed": self.crashed, "clock": self.clock}
        return glob, tuple(self.slot(i) for i in range(SLOTS))

    def slot(self, rid: int) -> Values:
        p = self.allocator.config.page_size
        held = {name: sum(1 for owner in pool.owner if owner == rid)
                for name, pool in (("full", self.allocator.full), ("swa", self.allocator.swa))}
        req = {"at": self.stamp.get(rid, 0)}
        for r in self.node.queue:
            if r.rid == rid:
                return {**req, **self._req(r), "status": spec.QUEUED, "m": 0, **held}
        for run in self.node.running:
            if run.rid == rid:
                assert run.swa_evicted_seqlen % p == 0, run
                return {**req, **self._req(run), "status": spec.RUNNING, "m": run.swa_evicted_seqlen // p, **held}
        for back in self.node.retracted:
            if back.rid == rid:  # the saved SWA rows start at the mark: the CPU copy's first mapped position
                mark = back.kv.swa_mask.index(True) if any(back.kv.swa_mask) else back.length
                assert mark % p == 0, back.kv.swa_mask
                return {**req, **self._req(back), "status": spec.RETRACTED, "m": mark // p, **held}
        if rid in self.last:  # finished: it reached max_new_tokens, holds nothing, keeps its last mark
            last = self.last[rid]
            return {**last, "status": spec.FINISHED, "out": last["max_new"], "full": 0, "swa": 0, **held}
        return {"status": spec.ABSENT, "orig": 0, "out": 0, "max_new": 0, "m": 0, "at": 0, **held}

    @staticmethod
    def _req(r: dp.DecodeRequest) -> Values:
        return {"orig": r.origin_input_len, "out": r.output_len, "max_new": r.max_new_tokens}

    # ---- one sampled step -------------------------------------------------------------------

    def step(self) -> Sample:
        rng, pre = self.rng, self.state()
        running = [r.rid for r in self.node.running]
        choices = ["pop_preallocated", "decode", "decode", "decode", "resume_retracted_reqs"]
        choices += ["arrive"] * (2 if self.arrived < SLOTS else 0)
        choices += ["retract"] * (1 if running and (self.flavour != "long" or rng.random() < 0.3) else 0)
        op = rng.choice(choices)
        if self.flavour == "tight" and self.arrived < SLOTS:  # a full queue before the first round
            op = "arrive"
        scripted = bool(self.script)
        if scripted:
            op = self.script.pop(0)
            if op == "retract" and not running:
                op, self.script = "pop_preallocated", []
        if not scripted and rng.random() < 0.08:  # a call the reference rejects: the model must not take it either
            return self._rejected(pre)
        action: Values = {"slot": 0, "orig": 0, "out": 0, "max_new": 0}
        events: list[str] = []
        if op == "arrive":
            out, p = rng.randint(1, 2), self.allocator.config.page_size
            orig = rng.randint(1, 6 if self.flavour == "long" else 10)
            if self.flavour == "tight":  # one token into a page: the most rounding drift (R4)
                out, orig = 1, rng.choice((p + 1, 2 * p + 1, orig))
            if scripted and self.flavour == "room":  # M1's shape: a short prompt with a long way to go, then a
                out = 1                              # longer prompt close to done (the one retracted and resumed)
                orig = rng.randint(1, p + 1) if self.arrived == 0 else rng.randint(2 * p, 3 * p + 1)
            longest = 16 if self.flavour in ("long", "room") else 8
            action = {"slot": self.arrived, "orig": orig, "out": out, "max_new": rng.randint(out + 1, out + longest)}
            if scripted and self.flavour == "room" and self.arrived == 1:
                action["max_new"] = rng.randint(out + 1, out + 2)
            self.node = dp.arrive(self.node, self.arrived, int(action["orig"]), out, int(action["max_new"]))
            self.arrived += 1
        elif op == "retract":
            rid = rng.choice(running)
            action["slot"] = rid
            self._apply(dp.retract(self.node, self.allocator, rid))
            self.stamp[rid], self.clock = self.clock, self.clock + 1
        else:
            for run in self.node.running:  # a request that finishes keeps its mark before the step
                self.last[run.rid] = self.slot(run.rid)
            result = getattr(dp, op)(self.node, self.allocator)
            events += ["stall"] * result.stalled + ["crash"] * (result.crash is not None)
            if op == "resume_retracted_reqs" and result.rids and not self._room_admits():
                events.append("resumed past the finish room")  # M1: budgets keeping the room would refuse it
            events += ["finish"] * len(result.rids) if op == "decode" else [f"{op}:{len(result.rids)}"]
            self._apply(result)
        post = self.state()
        moved = [a["m"] != b["m"] and b["status"] == spec.RUNNING for a, b in zip(pre[1], post[1], strict=True)]
        events += ["evict"] if op == "decode" and any(moved) else []
        return Sample(op, pre, action, post, tuple(events))

    def _room_admits(self) -> bool:
        """Whether the first retracted request passes the resume gate over budgets that keep the "can finish" room
        (the model before M1)."""
        budgets = dp.allocatable_token_budgets(self.node, self.allocator, count_retracted=False)
        return dp.resume_gate(self.node, self.allocator, budgets, self.node.retracted[0]).admit

    def _apply(self, result: dp.StepResult) -> None:
        self.node, self.allocator = result.node, result.allocator
        self.crashed = result.crash is not None

    def _rejected(self, pre: tuple[Values, tuple[Values, ...]]) -> Sample:
        """A call the reference rejects: retract a request that is not running, arrive with a rid the node
        knows, or arrive with nothing left to decode."""
        queued = [r.rid for r in self.node.queue]
        known = [r.rid for r in (*self.node.queue, *self.node.running, *self.node.retracted)]
        pick = self.rng.random()
        if queued and pick < 0.4:
            with pytest.raises(InvalidOperation):
                dp.retract(self.node, self.allocator, queued[0])
            return Sample("retract", pre, {"slot": queued[0], "orig": 0, "out": 0, "max_new": 0}, None)
        out = self.rng.randint(1, 3)
        if known and pick < 0.7:
            rid, max_new = self.rng.choice(known), out + 1
        else:
            rid, max_new = min(self.arrived, SLOTS - 1), out
        bad: Values = {"slot": rid, "orig": self.rng.randint(1, 12), "out": out, "max_new": max_new}
        with pytest.raises(InvalidOperation):
            dp.arrive(self.node, rid, int(bad["orig"]), out, max_new)
        return Sample("arrive", pre, bad, None)


@functools.cache
def samples() -> tuple[Sample, ...]:
    """``RUNS`` seeded runs of up to ``STEPS`` steps, then ``ROOM_RUNS`` of the ``room`` flavour; a run ends when the
    node crashes."""
    out: list[Sample] = []
    for seed in range(RUNS + ROOM_RUNS):
        tracker = Tracker(random.Random(seed), ("mixed", "mixed", "long", "tight")[seed % 4] if seed < RUNS else "room")
        for _ in range(STEPS):
            sample = tracker.step()
            out.append(sample)
            if tracker.crashed:
                break
    return tuple(out)


# ---- encoding concrete values as facts ------------------------------------------------------------

Pins = list[tuple[z3.ExprRef, z3.ExprRef]]


def state_pins(s: spec.State, values: tuple[Values, tuple[Values, ...]]) -> Pins:
    """Each variable of ``s`` with its concrete value."""
    glob, slots = values
    terms = {"P": s.k.P, "W": s.k.W, "R": s.k.R, "CLIP": s.k.CLIP, "corrected": s.corrected,
             "full_total": s.full_total, "swa_total": s.swa_total, "free_full": s.free_full,
             "free_swa": s.free_swa, "crashed": s.crashed, "clock": s.clock}
    pins = [(terms[name], _ts.literal(v)) for name, v in glob.items()]
    return pins + [(getattr(slot, name), _ts.literal(v)) for slot, vals in zip(s.slots, slots, strict=True)
                   for name, v in vals.items()]


def action_pins(a: spec.Action, values: Values) -> Pins:
    return [(getattr(a, name), _ts.literal(v)) for name, v in values.items()]


def _pins(sample: Sample) -> tuple[Any, Any, Any]:
    assert sample.post is not None
    pre, post, action = sample.pre, sample.post, sample.action
    return (lambda s: state_pins(s, pre)), (lambda t: state_pins(t, post)), (lambda a: action_pins(a, action))


def evaluates(system: _ts.TransitionSystem[spec.State, spec.Action], sample: Sample) -> bool | None:
    """The transition of the sample's op with every variable replaced by the sample's value (the kit's fast path):
    true, false, or None when it does not simplify to a literal."""
    return _ts.evaluate(system, sample.op, *_pins(sample))


def accepts(system: _ts.TransitionSystem[spec.State, spec.Action], sample: Sample) -> _ts.Acceptance:
    """Evaluated by substitution; a rejection (or a term that does not evaluate) is solved by the kit's ``accepts``,
    whose verdict names the conflicting facts."""
    return _ts.accepts_pinned(system, sample.op, *_pins(sample))


def has_successor(sample: Sample) -> bool:
    """Some post-state satisfies the transition from the sampled pre-state and action."""
    return _ts.has_successor(SYSTEM, sample.op, lambda s: state_pins(s, sample.pre),
                             lambda a: action_pins(a, sample.action))


# ---- the tests --------------------------------------------------------------------------------------

REFERENCE_OPS = ("arrive", "pop_preallocated", "decode", "retract", "resume_retracted_reqs")
"""The state-changing operations of ``kvproof.reference.decode_prealloc``."""


def test_every_reference_operation_has_a_transition_and_obligations() -> None:
    """One name everywhere: the reference function, the transition, the obligations' prefix (``prove -k <op>``)."""
    assert systems("decode_prealloc") == (spec.SYSTEM,)
    assert spec.SYSTEM.ops == REFERENCE_OPS == OPS
    for op in REFERENCE_OPS:
        assert callable(getattr(dp, op)), op
        found = obligations("decode_prealloc", f"decode_prealloc.{op}.")
        assert any(ob.twin_of is None for ob in found) and any(ob.twin_of for ob in found), op



@pytest.mark.parametrize("op", OPS)
def test_every_sampled_step_is_accepted_by_its_transition(op: str) -> None:
    steps = [s for s in samples() if s.op == op and s.post is not None]
    assert len(steps) >= 20, f"only {len(steps)} sampled {op} steps"
    for sample in steps:
        verdict = accepts(SYSTEM, sample)
        assert verdict.accepted, f"{verdict}\npre {sample.pre}\naction {sample.action}\npost {sample.post}"


def test_calls_the_reference_rejects_have_no_successor() -> None:
    rejected = [s for s in samples() if s.post is None]
    assert {s.op for s in rejected} == {"arrive", "retract"} and len(rejected) >= 20
    for sample in rejected:
        assert not has_successor(sample), f"{sample.op}{sample.action} from {sample.pre} is a step of the model"


def test_the_samples_cover_every_branch() -> None:
    """Rounds admitting two or more requests, resumes of two, UPSTREAM crashes, stalls, evictions, finishing, and
    resumptions that budgets keeping the "can finish" room would refuse."""
    events = Counter(e for s in samples() for e in s.events)
    assert events["crash"] >= 3 and events["stall"] >= 10 and events["evict"] >= 5, events
    assert events["pop_preallocated:2"] + events["pop_preallocated:3"] >= 10, events
    assert events["resume_retracted_reqs:1"] >= 10 and events["resume_retracted_reqs:2"] >= 1, events
    assert events["finish"] >= 10, events
    assert events["resumed past the finish room"] >= 3, events  # M1: what the model before it would not step to
    assert {s.pre[0]["corrected"] for s in samples()} == {True, False}


@pytest.mark.parametrize(("op", "wrong"), [
    ("pop_preallocated", functools.partial(spec.pop_preallocated, marks_tail=False)),  # the PR era, R6
    ("retract", functools.partial(spec.retract, swa_by_length=True)),
    ("resume_retracted_reqs", functools.partial(spec.resume_retracted_reqs, reserve_finish=True)),  # before M1
])
def test_a_wrong_transition_rejects_sampled_steps(op: str, wrong: Callable[..., z3.BoolRef]) -> None:
    system = SYSTEM.with_transitions(**{op: wrong})
    steps = [s for s in samples() if s.op == op and s.post is not None]
    rejected = [s for s in steps if evaluates(system, s) is False]
    assert rejected, f"the wrong {op} accepts all {len(steps)} sampled steps"
    verdict = accepts(system, rejected[0])
    assert verdict.status == "rejected" and verdict.conflict, verdict

"""hisparse_host drift: every transition of the Z3 model accepts the steps the reference takes.

Seeded reference runs of ``kvproof.reference.hisparse_host`` (small host pools of both
coordinators, two request slots: sglang_semantics.md §4) call every operation, the reads
included, with mostly valid and some invalid arguments. Each step is abstracted into the
model's state (:class:`kvproof.spec.hisparse_host.State`: free slots, slots held by no
row, per row its allocated length, skip flag and written prefix) and checked against the
transition of the same name with concrete values in a fresh Z3 context; a call the reference
rejects must have no successor in the model. Deliberately wrong transitions reject sampled
steps, so these checks can fail. (The arithmetic builders' drift tests are in
``test_hisparse_host.py``.)
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import z3

from kvproof.reference import hisparse_host as hh
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.spec import _ts, obligations, systems
from kvproof.spec import hisparse_host as spec

SYSTEM = spec.SYSTEM
SLOTS = spec.R_SLOTS
RUNS, STEPS = 60, 24

Values = dict[str, object]
Pins = list[tuple[z3.ExprRef, z3.ExprRef]]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reference call as the model sees it; ``post`` is None when the reference rejected it."""

    op: str
    pre: Values
    action: Values
    post: Values | None
    error: str = ""


def abstract(state: hh.HostPoolState) -> Values:
    """The model's view of a reference state: slot counts as (pages, extra), flags, written prefixes."""
    c, p = state.config, state.config.page_size
    rows = []
    for r, row in enumerate(state.rows):
        filled = next((j for j, slot in enumerate(row) if state.data[slot] is None), len(row))
        rows.append({"alen": divmod(len(row), p), "skip": state.skip_first_backup[r], "filled": filled})
    loose = c.size - len(state.free_slots) - sum(len(row) for row in state.rows)
    return {"P": p, "num_pages": c.num_pages, "M": c.max_context_len, "paged": c.coordinator is hh.Coordinator.PAGED,
            "free": divmod(len(state.free_slots), p), "loose": divmod(loose, p), "rows": rows}


def _positions(state: hh.HostPoolState, slots: Sequence[int]) -> list[int]:
    """Per row, one past the last row position among ``slots`` (0: none); slots are owned by some row."""
    upto = [0] * SLOTS
    for slot in slots:
        r, j = next((r, row.index(slot)) for r, row in enumerate(state.rows) if slot in row)
        upto[r] = max(upto[r], j + 1)
    return upto


class Tracker:
    """A reference run: the pool, each staged row's next seq_len, and a seeded choice of calls."""

    def __init__(self, rng: random.Random) -> None:
        pre = rng.random() < 0.25
        p = rng.choice((1, 2, 2) if pre else (1, 2, 3, 4))
        config = hh.HostPoolConfig(page_size=p, num_pages=rng.randint(3, 10), max_req_slots=SLOTS,
                                   max_context_len=rng.randint(3, 12),
                                   coordinator=hh.Coordinator.PRE_23606 if pre else hh.Coordinator.PAGED)
        self.state, self.rng = hh.initial_state(config), rng
        self.seq = [0] * SLOTS  # the next backup's seq_len of a staged row
        self.value = 1000

    def _values(self, n: int) -> list[int]:
        self.value += n
        return list(range(self.value - n, self.value))

    def step(self) -> Sample:
        rng, state, p = self.rng, self.state, self.state.config.page_size
        staged = [r for r in range(SLOTS) if state.rows[r]]
        owned = [slot for row in state.rows for slot in row]
        empty = [r for r in range(SLOTS) if not state.rows[r]]
        odd = rng.random() < 0.1  # now and then a call whatever the state (often rejected)
        op = rng.choice(["admit_request_into_staging"] * (3 if empty or odd else 0)
                        + ["eager_backup_previous_token"] * (5 if staged or odd else 0)
                        + ["request_finished"] * (1 + 2 * (not empty))
                        + ["alloc_paged_token_slots", "set_host_data", "get_host_data", "allocated_host_indices"]
                        + ["alloc", "alloc_page"] * (rng.random() < 0.6))
        mine = empty if op == "admit_request_into_staging" else staged
        req = rng.choice(mine) if mine and rng.random() < 0.85 else rng.randrange(SLOTS + (rng.random() < 0.3))
        action: Values = {"req": req}
        call: Callable[[], object]
        if op == "alloc":
            action["n"] = rng.randint(0, 2 * p)
            call = functools.partial(hh.alloc, state, action["n"])
        elif op == "alloc_page":
            action["n"] = rng.randint(0, 2)
            call = functools.partial(hh.alloc_page, state, action["n"])
        elif op == "alloc_paged_token_slots":
            alen = len(state.rows[req]) if req < SLOTS else 0
            action["start"], action["n"] = rng.randint(0, alen + 1), rng.randint(-1, p + 2)
            call = functools.partial(hh.alloc_paged_token_slots, state, req, action["start"], action["n"])
        elif op == "request_finished":
            call = functools.partial(hh.request_finished, state, req)
        elif op in ("set_host_data", "get_host_data"):
            slots = rng.sample(owned, k=min(len(owned), rng.randint(0, 3)))
            action["upto"] = _positions(state, slots)
            call = (functools.partial(hh.set_host_data, state, slots, self._values(len(slots)))
                    if op == "set_host_data" else functools.partial(hh.get_host_data, state, slots))
        elif op == "admit_request_into_staging":
            action["n"] = rng.randint(1, state.config.max_context_len + 1)
            if state.config.coordinator is hh.Coordinator.PRE_23606 and rng.random() < 0.7:  # the page rule
                action["n"] = p * rng.randint(1, max(1, state.config.max_context_len // p))
            call = functools.partial(hh.admit_request_into_staging, state, req, self._values(int(action["n"])))
        elif op == "eager_backup_previous_token":
            batch = sorted(rng.sample(staged, k=rng.randint(1, len(staged)))) if staged else [min(req, SLOTS - 1)]
            seqs = [self.seq[r] if rng.random() < 0.9 else rng.randint(1, self.seq[r] + 3) for r in batch]
            action["batch"] = [r in batch for r in range(SLOTS)]
            action["seq"] = [seqs[batch.index(r)] if r in batch else 0 for r in range(SLOTS)]
            call = functools.partial(hh.eager_backup_previous_token, state, batch, seqs, self._values(len(batch)))
        else:
            call = functools.partial(hh.allocated_host_indices, state, req)
        return self._run(op, action, call)

    def _run(self, op: str, action: Values, call: Callable[[], object]) -> Sample:
        pre = abstract(self.state)
        try:
            out = call()
        except (InvalidOperation, OutOfMemory) as err:
            return Sample(op, pre, action, None, type(err).__name__)
        if op == "allocated_host_indices":
            action["count"] = len(out)
        elif op == "get_host_data":
            action["count"] = sum(v is None for v in out)
        else:
            self.state = out[0] if isinstance(out, tuple) else out
        if op == "admit_request_into_staging":
            self.seq[int(action["req"])] = int(action["n"]) + 1
        elif op == "eager_backup_previous_token":
            for r, on in enumerate(action["batch"]):
                self.seq[r] += bool(on)
        return Sample(op, pre, action, abstract(self.state))


@functools.cache
def samples() -> tuple[Sample, ...]:
    out: list[Sample] = []
    for seed in range(RUNS):
        tracker = Tracker(random.Random(seed))
        out += [tracker.step() for _ in range(STEPS)]
    return tuple(out)


# ---- encoding concrete values as facts ------------------------------------------------------------


def _count(c: spec.Count, v: object) -> Pins:
    pages, extra = v
    return [(c.pages, _ts.literal(pages)), (c.extra, _ts.literal(extra))]


def state_pins(s: spec.State, v: Values) -> Pins:
    pins = [(s.P, _ts.literal(v["P"])), (s.num_pages, _ts.literal(v["num_pages"])), (s.M, _ts.literal(v["M"])),
            (s.paged, _ts.literal(v["paged"])), *_count(s.free, v["free"]), *_count(s.loose, v["loose"])]
    for row, values in zip(s.rows, v["rows"], strict=True):
        pins += [*_count(row.alen, values["alen"]), (row.skip, _ts.literal(values["skip"])),
                 (row.filled, _ts.literal(values["filled"]))]
    return pins


def action_pins(a: spec.Action, v: Values) -> Pins:
    """Every argument field: the sampled ones, 0 / False for the rest (so the relation closes)."""
    full = {"req": 0, "start": 0, "n": 0, "count": 0, "batch": [False] * SLOTS, "seq": [0] * SLOTS,
            "upto": [0] * SLOTS, **v}
    pins = [(getattr(a, name), _ts.literal(full[name])) for name in ("req", "start", "n", "count")]
    for name in ("batch", "seq", "upto"):
        pins += [(x, _ts.literal(y)) for x, y in zip(getattr(a, name), full[name], strict=True)]
    return pins


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

REFERENCE_OPS = ("alloc", "alloc_page", "alloc_paged_token_slots", "request_finished", "set_host_data",
                 "admit_request_into_staging", "eager_backup_previous_token", "allocated_host_indices", "get_host_data")
"""The operations of ``kvproof.reference.hisparse_host`` (the last two are reads)."""


def test_every_reference_operation_has_a_transition_and_obligations() -> None:
    """One name everywhere: the reference function, the transition, the obligations' prefix (``prove -k <op>``)."""
    assert systems("hisparse_host") == (spec.SYSTEM,)
    assert SYSTEM.ops == REFERENCE_OPS
    for op in REFERENCE_OPS:
        assert callable(getattr(hh, op)), op
        found = obligations("hisparse_host", f"hisparse_host.{op}.")
        assert any(ob.twin_of is None for ob in found) and any(ob.twin_of for ob in found), op



@pytest.mark.parametrize("op", SYSTEM.ops)
def test_every_sampled_step_is_accepted_by_its_transition(op: str) -> None:
    steps = [s for s in samples() if s.op == op and s.post is not None]
    assert len(steps) >= 20, f"only {len(steps)} sampled {op} steps"
    for sample in steps:
        verdict = accepts(SYSTEM, sample)
        assert verdict.accepted, f"{verdict}\npre {sample.pre}\naction {sample.action}\npost {sample.post}"


def test_calls_the_reference_rejects_have_no_successor() -> None:
    rejected = [s for s in samples() if s.post is None]
    assert Counter(s.error for s in rejected).keys() == {"InvalidOperation", "OutOfMemory"}
    assert len({s.op for s in rejected}) >= 6, Counter(s.op for s in rejected)
    for sample in rejected:
        assert not has_successor(sample), f"{sample.op}{sample.action} ({sample.error}) from {sample.pre}"


def test_the_samples_cover_both_coordinators_and_every_kind_of_step() -> None:
    steps = [s for s in samples() if s.post is not None]
    assert {s.pre["paged"] for s in steps} == {True, False}
    assert {s.pre["P"] for s in steps} == {1, 2, 3, 4}
    grew = [s for s in steps if s.op == "eager_backup_previous_token" and s.post["rows"] != s.pre["rows"]
            and any(a["alen"] != b["alen"] for a, b in zip(s.pre["rows"], s.post["rows"], strict=True))]
    assert len(grew) >= 5, "backups that open a page"
    skipped = [s for s in steps if s.op == "eager_backup_previous_token"
               and any(row["skip"] for row in s.pre["rows"])]
    assert len(skipped) >= 5, "backups that skip a freshly staged row"
    partial = [s for s in steps if any(row["alen"][1] for row in s.post["rows"])]
    assert partial, "pre-#23606 rows that are not whole pages"


@pytest.mark.parametrize(("op", "wrong"), [
    ("alloc_paged_token_slots", functools.partial(spec.alloc_paged_token_slots, keeps_held=False)),
    ("request_finished", functools.partial(spec.request_finished, clears_skip=False)),
    ("eager_backup_previous_token", functools.partial(spec.eager_backup_previous_token, clears_skip=False)),
])
def test_a_wrong_transition_rejects_sampled_steps(op: str, wrong: Callable[..., z3.BoolRef]) -> None:
    system = SYSTEM.with_transitions(**{op: wrong})
    steps = [s for s in samples() if s.op == op and s.post is not None]
    rejected = [s for s in steps if evaluates(system, s) is False]
    assert rejected, f"the wrong {op} accepts all {len(steps)} sampled steps"
    verdict = accepts(system, rejected[0])
    assert verdict.status == "rejected" and verdict.conflict, verdict

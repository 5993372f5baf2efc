"""admission drift: every transition of the Z3 models accepts the steps the reference takes, under each policy.

Seeded reference runs of ``kvproof.reference.admission`` (small random trees with device nodes, host tombstones
and nodes without SWA, requests sharing them, rounds, evictions, completions, standalone load-backs, chunked
requests cached and continued; sglang_semantics.md §5) call every scheduler operation. Each step is abstracted
into the model's state (:class:`kvproof.spec.admission.State`: ``room`` = free + evictable pages, protected and
held pages, the round's adder) and action (what the window walk finds now, the match-time value, the verdict,
a continuation's prompt left and own tokens) and checked against the transition of the same name in the
policy's system with concrete values; a call the reference rejects (a misuse, or out of memory) has no
successor in the model. Deliberately wrong transitions reject sampled steps, so these checks can fail.
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

from kvproof.reference import admission as ad
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.spec import _ts
from kvproof.spec import admission as spec

Policy = ad.AdmissionPolicy
RUNS, STEPS = 80, 40
Values = dict[str, Any]
Pins = list[tuple[z3.ExprRef, z3.ExprRef]]
RESULT = {ad.AddReqResult.CONTINUE: spec.CONTINUE, ad.AddReqResult.NO_TOKEN: spec.NO_TOKEN,
          ad.AddReqResult.OTHER: spec.OTHER, ad.ChunkedResult.DEFERRED: spec.DEFERRED,
          ad.ChunkedResult.TRUNCATED: spec.TRUNCATED, ad.ChunkedResult.LAST: spec.LAST}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reference call as the model sees it; ``post`` is None when the reference rejected it."""

    policy: Policy
    op: str
    pre: Values
    action: Values
    post: Values | None
    error: str = ""


def abstract(state: ad.AdmissionState) -> Values:
    c, adder = state.config, state.adder
    p = c.page_size
    pending = sum(ad.chunk_pages(state, r) for r in adder.can_run) if adder else 0
    chunk = c.chunk_size or p  # the model's C when chunked prefill is off: any value >= P
    rem_chunk = adder.rem_chunk_tokens if adder is not None and adder.rem_chunk_tokens is not None else chunk
    return {"P": p, "W": c.sliding_window, "T": c.swa_pages, "C": chunk, "chunking": c.chunk_size is not None,
            "room": state.available + ad.swa_evictable_pages(state), "locked": ad.swa_protected_pages(state),
            "held": ad.swa_held_pages(state), "open": adder is not None,
            "offset": adder.rem_swa_token_offset if adder else 0, "rem_chunk": rem_chunk, "pending": pending,
            "chunked": adder is not None and adder.new_chunked_req is not None}


def walk_action(state: ad.AdmissionState, rid: int) -> Values:
    """What ``add_one_req`` / ``init_load_back`` read of the tree now, and the match-time snapshot."""
    req, p = state.requests[rid], state.config.page_size
    walk = ad.window_walk(state, req.node)
    own_sel = ad.window_walk(state, ad.last_device_node(state, req.node)).unlocked_device_pages
    out: Values = {"m": req.max_new_tokens, "own": walk.unlocked_device_pages, "own_sel": own_sel,
                   "lb_whole": walk.host_tokens // p,
                   "lb_cap": walk.capped_tokens // p}
    if req.match is not None:
        e_after = req.prompt_len - ad.path_len(state, req.node)
        out |= {"e": req.prompt_len - req.match.device_prefix_len, "h_snap": req.match.swa_host_hit_length // p}
        out["host_full"] = out["e"] - e_after
    return out


class Tracker:
    """A reference run under one policy with a seeded choice of calls."""

    def __init__(self, rng: random.Random, policy: Policy) -> None:
        page, window = rng.choice((1, 2, 4)), rng.randint(1, 9)
        nodes: list[ad.Node] = []
        for i in range(rng.randint(1, 6)):
            parent = rng.randrange(-1, i)
            full = rng.random() < 0.8 and (parent == -1 or nodes[parent].full_on_device)
            swa = rng.choice((ad.SwaValue.DEVICE, ad.SwaValue.HOST, ad.SwaValue.HOST, ad.SwaValue.NONE)) if full \
                else rng.choice((ad.SwaValue.HOST, ad.SwaValue.NONE))
            nodes.append(ad.Node(parent=parent, length=page * rng.randint(1, 7), full_on_device=full, swa=swa))
        used = sum(n.length // page for n in nodes if n.swa is ad.SwaValue.DEVICE)
        config = ad.AdmissionConfig(page_size=page, sliding_window=window,
                                    swa_pages=max(1, used + rng.randint(2, 30) // page),
                                    chunk_size=rng.choice((None, page, 2 * page, 3 * page + 1, 6 * page)),
                                    policy=policy)
        self.state, self.rng, self.policy = ad.initial_state(config, nodes), rng, policy
        self.unlock: tuple[ad.AdmissionState, int, tuple[int, ...]] = (self.state, 0, ())

    def waiting(self, matched: bool) -> list[int]:
        return [i for i, r in enumerate(self.state.requests)
                if r.status is ad.ReqStatus.WAITING and (r.match is not None or not matched)]

    def step(self) -> Sample:
        rng, state = self.rng, self.state
        running = [i for i, r in enumerate(state.requests) if r.status is ad.ReqStatus.RUNNING]
        done = [i for i in running if state.requests[i].prefix_len + state.requests[i].extend_len
                == state.requests[i].prompt_len]
        unfinished = [i for i in running if i not in done]
        chunked = [i for i, r in enumerate(state.requests) if r.status is ad.ReqStatus.CHUNKED]
        odd = rng.random() < 0.08
        # as the scheduler: a chunk that ran is cached before the next round opens, which continues it first
        opens = (state.adder is None and not unfinished) or odd
        weights = {"arrive": 2, "get_new_batch_prefill": (6 if chunked else 2) if opens else 0,
                   "match_prefix_for_req": 3 if self.waiting(False) else 0,
                   "add_one_req": 6 if (state.adder is not None and self.waiting(True)) or odd else 0,
                   "init_load_back": 1 if self.waiting(True) else 0,
                   "add_chunked_req": 10 if (state.adder is not None and chunked) or odd else 0,
                   "prepare_for_extend": 2 if state.adder is not None or odd else 0, "evict": 1,
                   "cache_unfinished_req": 8 if (state.adder is None and unfinished) or odd else 0,
                   "cache_finished_req": 2 if done or odd else 0}
        op = rng.choices(list(weights), weights=list(weights.values()))[0]
        action: Values = {}
        call: Callable[[], object]
        if op == "arrive":
            node = rng.randrange(-1, len(state.nodes))
            extend = rng.randint(1, 20) if rng.random() < 0.7 else rng.randint(20, 48)  # long ones run many chunks
            call = functools.partial(ad.arrive, state, ad.path_len(state, node) + extend,
                                     rng.randint(0, 6), node)
        elif op == "get_new_batch_prefill":
            call = functools.partial(ad.get_new_batch_prefill, state)
        elif op == "match_prefix_for_req":
            call = functools.partial(ad.match_prefix_for_req, state, rng.choice(self.waiting(False)))
        elif op == "add_one_req":
            rid = rng.choice(self.waiting(True) or [0])
            action = walk_action(state, rid) if rid < len(state.requests) and state.requests[rid].match else {}
            call = functools.partial(ad.add_one_req, state, rid)
        elif op == "init_load_back":
            # a load-back on its own needs the request's window lock: taken before, released after the call
            rid = rng.choice(self.waiting(True))
            req = state.requests[rid]
            locked, held = ad.inc_lock_ref(state, req.node) if req.node != -1 else (state, ())
            self.unlock = (state, rid, held)
            state = self.state = _with_locked(locked, rid, held)
            action = walk_action(state, rid)
            call = functools.partial(ad.init_load_back, state, rid)
        elif op == "add_chunked_req":
            rid = rng.choice(chunked or [0])
            if rid < len(state.requests):
                req = state.requests[rid]
                action = {"e": req.prompt_len - req.prefix_len, "m": req.max_new_tokens,
                          "done": ad.own_len(state, rid) if req.status is ad.ReqStatus.CHUNKED else 0}
            call = functools.partial(ad.add_chunked_req, state, rid)
        elif op == "cache_unfinished_req":
            rid = rng.choice(unfinished or running or [0])
            call = functools.partial(ad.cache_unfinished_req, state, rid)
        elif op == "prepare_for_extend":
            call = functools.partial(ad.prepare_for_extend, state)
        elif op == "evict":
            action = {"n": rng.randint(0, 4)}
            call = functools.partial(ad.evict, state, action["n"])
        else:
            rid = rng.choice(done or running or [0])
            action = {"freed": state.requests[rid].swa_pages if rid < len(state.requests) else 0}
            call = functools.partial(ad.cache_finished_req, state, rid)
        return self._run(op, action, call)

    def _run(self, op: str, action: Values, call: Callable[[], object]) -> Sample:
        pre = abstract(self.state)
        try:
            out = call()
        except (InvalidOperation, OutOfMemory) as err:
            if op == "init_load_back":
                self.state = self.unlock[0]
            return Sample(self.policy, op, pre, action, None, type(err).__name__)
        new = out[0] if isinstance(out, tuple) else out
        assert isinstance(new, ad.AdmissionState)
        post = abstract(new)
        if op == "add_one_req":
            assert isinstance(out, tuple)
            action["result"] = RESULT[out[1]]
            lb = action["lb_cap"] if self.policy is Policy.CORRECTED else action["lb_whole"]
            # OTHER without a page of chunk leaves the adder as it was and releases the lock: ``back`` pages return
            gave_up = out[1] is ad.AddReqResult.OTHER and new.adder == self.state.adder
            action["back"] = post["room"] - (pre["room"] - action["own"] - lb) if gave_up else 0
        elif op == "add_chunked_req":
            assert isinstance(out, tuple)
            action["result"] = RESULT[out[1]]
        elif op == "cache_unfinished_req":
            action["freed"] = pre["held"] - post["held"]
        elif op == "cache_finished_req":
            action["back"] = post["room"] - pre["room"] - action["freed"]
        elif op == "init_load_back":
            _, rid, held = self.unlock
            new = _with_locked(ad.dec_lock_ref(new, held), rid, ())
        self.state = new
        return Sample(self.policy, op, pre, action, post)


def _with_locked(state: ad.AdmissionState, rid: int, held: tuple[int, ...]) -> ad.AdmissionState:
    reqs = list(state.requests)
    reqs[rid] = reqs[rid].model_copy(update={"locked": held})
    return state.model_copy(update={"requests": tuple(reqs)})


def pinned_samples() -> list[Sample]:
    """0.5.23's selection pin, which random trees rarely reach: the best-match window is a host tombstone under a
    Full host node, the last device node's window holds unlocked device SWA the pin protects. Pinned, the request
    (5 tokens to extend, a 4-token tombstone) needs 12 tokens and 12 are left: refused; unpinned, 16: admitted."""
    node = functools.partial(ad.Node, full_on_device=True)
    nodes = (node(parent=-1, length=4, swa=ad.SwaValue.DEVICE),
             node(parent=0, length=2, swa=ad.SwaValue.HOST, full_on_device=False),
             node(parent=1, length=4, swa=ad.SwaValue.HOST, full_on_device=False),
             node(parent=-1, length=4, swa=ad.SwaValue.DEVICE))
    config = ad.AdmissionConfig(page_size=2, sliding_window=4, swa_pages=8, chunk_size=6, policy=Policy.UPSTREAM_0523)
    tracker = Tracker(random.Random(0), Policy.UPSTREAM_0523)
    tracker.state, _ = ad.arrive(ad.initial_state(config, nodes), 15, 0, 2)
    out = [tracker._run("get_new_batch_prefill", {}, functools.partial(ad.get_new_batch_prefill, tracker.state)),
           tracker._run("match_prefix_for_req", {}, functools.partial(ad.match_prefix_for_req, tracker.state, 0))]
    out.append(tracker._run("add_one_req", walk_action(tracker.state, 0),
                            functools.partial(ad.add_one_req, tracker.state, 0)))
    assert out[-1].action["result"] == spec.NO_TOKEN and out[-1].action["own_sel"] > out[-1].action["own"]
    return out


@functools.cache
def samples() -> tuple[Sample, ...]:
    out: list[Sample] = []
    for seed in range(RUNS):
        policy = list(Policy)[seed % len(Policy)]
        tracker = Tracker(random.Random(seed), policy)
        out += [tracker.step() for _ in range(STEPS)]
    out += pinned_samples()
    return tuple(s for s in out if s.op != "arrive")  # arrivals change nothing the model counts


# ---- encoding concrete values as facts ---------------------------------------------------------


def _v(x: object) -> z3.ExprRef:
    return z3.BoolVal(x) if isinstance(x, bool) else z3.IntVal(int(x))  # type: ignore[call-overload]


def state_pins(s: spec.State, v: Values) -> Pins:
    return [(getattr(s, name), _v(v[name])) for name in (f.name for f in dataclasses.fields(s))]


ACTION_FIELDS = ("e", "host_full", "m", "h_snap", "own", "own_sel", "lb_whole", "lb_cap", "back", "freed", "n",
                 "result", "done")


def action_pins(a: spec.Action, v: Values, *, free_result: bool = False) -> Pins:
    """Every argument: the sampled ones, 0 for the rest (so the relation closes); ``free_result`` leaves the verdict
    free (a rejected call has none)."""
    full = {**dict.fromkeys(ACTION_FIELDS, 0), **v}
    return [(getattr(a, name), _v(full[name])) for name in ACTION_FIELDS if not (free_result and name == "result")]


def evaluates(system: _ts.TransitionSystem[spec.State, spec.Action], sample: Sample) -> bool | None:
    assert sample.post is not None
    post = sample.post
    return _ts.evaluate(system, sample.op, lambda s: state_pins(s, sample.pre), lambda t: state_pins(t, post),
                        lambda a: action_pins(a, sample.action))


def accepts(system: _ts.TransitionSystem[spec.State, spec.Action], sample: Sample) -> _ts.Acceptance:
    assert sample.post is not None
    post = sample.post
    return _ts.accepts_pinned(system, sample.op, lambda s: state_pins(s, sample.pre), lambda t: state_pins(t, post),
                              lambda a: action_pins(a, sample.action))


def has_successor(sample: Sample) -> bool:
    return _ts.has_successor(spec.SYSTEMS_BY_POLICY[spec.Policy(sample.policy.value)], sample.op,
                             lambda s: state_pins(s, sample.pre),
                             lambda a: action_pins(a, sample.action, free_result=True))


# ---- the tests -------------------------------------------------------------------------------------


def test_every_scheduler_operation_has_a_transition_named_like_it() -> None:
    """One name everywhere: the reference function, the transition, the obligations' prefix."""
    assert spec.SYSTEM.ops == ("get_new_batch_prefill", "match_prefix_for_req", "add_one_req", "init_load_back",
                               "add_chunked_req", "prepare_for_extend", "evict", "cache_unfinished_req",
                               "cache_finished_req")
    for op in spec.SYSTEM.ops:
        assert callable(getattr(ad, op)), op
    assert [p.value for p in spec.Policy] == [p.value for p in Policy]
    assert all(s.component == "admission" for s in spec.SYSTEMS)


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("op", spec.SYSTEM.ops)
def test_every_sampled_step_is_accepted_by_its_transition(policy: Policy, op: str) -> None:
    system = spec.SYSTEMS_BY_POLICY[spec.Policy(policy.value)]
    steps = [s for s in samples() if s.op == op and s.post is not None and s.policy is policy]
    assert len(steps) >= 3, f"only {len(steps)} sampled {op} steps under {policy.value}"
    for sample in steps:
        verdict = accepts(system, sample)
        assert verdict.accepted, f"{verdict}\npre {sample.pre}\naction {sample.action}\npost {sample.post}"


def test_calls_the_reference_rejects_have_no_successor() -> None:
    rejected = [s for s in samples() if s.post is None]
    assert Counter(s.error for s in rejected).keys() == {"InvalidOperation", "OutOfMemory"}
    # what the model sees: out of memory, and the round's open/closed misuse (a request's status is not in it)
    # ... and the round a continuation needs open, a release closed
    modelled = [s for s in rejected if (s.error == "OutOfMemory" and s.action.get("e", 1))
                or s.op in ("get_new_batch_prefill", "prepare_for_extend")
                or (s.op == "add_chunked_req" and not s.pre["open"])
                or (s.op == "cache_unfinished_req" and s.pre["open"])]
    assert {s.op for s in modelled} >= {"init_load_back", "prepare_for_extend", "get_new_batch_prefill",
                                        "add_chunked_req", "cache_unfinished_req"}, Counter(s.op for s in modelled)
    for sample in modelled:
        assert not has_successor(sample), f"{sample.policy.value} {sample.op}{sample.action} ({sample.error}) " \
                                          f"from {sample.pre}"


def test_the_samples_cover_every_verdict_and_both_prefill_modes() -> None:
    steps = [s for s in samples() if s.op == "add_one_req" and s.post is not None]
    assert {s.action["result"] for s in steps} == {spec.CONTINUE, spec.NO_TOKEN, spec.OTHER}
    assert {s.pre["chunking"] for s in steps} == {True, False}
    assert any(s.action["lb_whole"] > s.action["lb_cap"] for s in steps), "tombstones longer than the window"
    assert any(s.action["h_snap"] != s.action["lb_whole"] for s in steps), "stale match-time values"
    chunks = [s for s in samples() if s.op == "add_chunked_req" and s.post is not None]
    assert {s.action["result"] for s in chunks} == {spec.DEFERRED, spec.TRUNCATED, spec.LAST}
    assert any(s.action["done"] % s.pre["P"] for s in chunks), "a continuation after a chunk that ends inside a page"
    assert any(s.action["freed"] > 0 for s in samples() if s.op == "cache_unfinished_req" and s.post is not None)
    ooms = [s for s in samples() if s.error == "OutOfMemory"]
    assert {s.policy for s in ooms} >= {Policy.PRE_27391}, "pre_27391 runs out after admission"
    assert not [s for s in ooms if s.policy is Policy.CORRECTED and s.op in ("add_one_req", "prepare_for_extend")
                and s.pre["open"]], "corrected never runs out after admission in a round"


def _frees_nothing(s: spec.State, a: spec.Action, t: spec.State) -> z3.BoolRef:
    """Wrong: a release that never frees a page (every chunk's pages kept until completion)."""
    return z3.And(spec.cache_unfinished_req(s, a, t), a.freed == 0)


@pytest.mark.parametrize(("op", "policy", "wrong"), [
    ("add_chunked_req", Policy.CORRECTED, spec.SYSTEM.with_transitions(add_chunked_req=functools.partial(
        spec.add_chunked_req, page_left=False))),
    ("add_chunked_req", Policy.UPSTREAM_0523, spec.SYSTEM),  # corrected's reservation ignores max_new_tokens
    ("cache_unfinished_req", Policy.CORRECTED, spec.SYSTEM.with_transitions(cache_unfinished_req=_frees_nothing)),
])
def test_a_wrong_chunk_transition_rejects_sampled_steps(op: str, policy: Policy,
                                                        wrong: _ts.TransitionSystem[spec.State, spec.Action]) -> None:
    steps = [s for s in samples() if s.op == op and s.post is not None and s.policy is policy]
    rejected = [s for s in steps if evaluates(wrong, s) is False]
    assert rejected, f"the wrong {op} accepts all {len(steps)} sampled {policy.value} steps"


@pytest.mark.parametrize(("policy", "wrong"), [
    (Policy.CORRECTED, spec.SYSTEMS_BY_POLICY[spec.Policy.UPSTREAM_27391]),
    (Policy.UPSTREAM_27391, spec.SYSTEMS_BY_POLICY[spec.Policy.PRE_27391]),
    (Policy.UPSTREAM_0523, spec.SYSTEMS_BY_POLICY[spec.Policy.UPSTREAM_27391]),
    (Policy.CORRECTED, spec.SYSTEM.with_transitions(add_one_req=functools.partial(
        spec.add_one_req, variant=spec.Variant(capped_load=False)))),
])
def test_a_wrong_transition_rejects_sampled_steps(policy: Policy,
                                                  wrong: _ts.TransitionSystem[spec.State, spec.Action]) -> None:
    steps = [s for s in samples() if s.op == "add_one_req" and s.post is not None and s.policy is policy]
    rejected = [s for s in steps if evaluates(wrong, s) is False]
    assert rejected, f"the wrong add_one_req accepts all {len(steps)} sampled {policy.value} steps"
    verdict = accepts(wrong, rejected[0])
    assert verdict.status == "rejected" and verdict.conflict, verdict

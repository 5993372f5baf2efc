"""Stateful simulation of a PD decode node (component ``decode_prealloc``, sglang_semantics.md §2, §7 D1-D3).

Requests arrive with random prompt lengths, are admitted and preallocated by the
reference scheduler (``kvproof.reference.decode_prealloc``: budgets, gates, policy),
decode one token per step (allocating, writing KV, releasing out-of-window SWA
pages), are retracted to CPU copies and resumed, and finish. Every allocator call
the reference scheduler makes is replayed on the implementation under test in
lockstep (same outcome class, results bound under the page renaming), so the same
machine runs against kvproof's torch runtime, the reference shell or any allocator.

After every step:

* D1 -- no admitted request failed its preallocation (the upstream policy crashes
  here: S2 and smaller; the corrected policy must never);
* no leak: every allocated page in either pool belongs to a running request;
* D3 -- a running request's SWA-resident positions stay within
  ``[floor_P(L - 1 - W - P), L)`` (tail mode);
* every running request's KV reads back what was written for it -- through
  retraction and resumption, every in-window SWA row survives -- in the reference,
  and the implementation agrees with the reference (the inherited comparison).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvproof.conformance import strategies as st
from kvproof.conformance.check import Suite
from kvproof.conformance.compare import Divergence
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.errors import HarnessBug
from kvproof.conformance.lockstep import check_after_each_step, operation
from kvproof.conformance.swa_allocator import Req, SWALockstep
from kvproof.reference import decode_prealloc as dp
from kvproof.reference import swa_allocator as ref
from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvariantViolation
from kvproof.reference.registry import Component

__all__ = ["DEFAULT_DECODE_CONFIG", "SUITE", "DecodePreallocMachine", "allocating_needs"]

C = Capability


def allocating_needs(config: PoolConfig) -> frozenset[Capability]:
    """What the reference scheduler calls on the allocator at this page size (``_pre_alloc``, decode, retract).

    P == 1: ``alloc`` preallocates; P > 1: ``alloc_extend_swa_tail`` (tail mode) and
    ``alloc_extend``. Decoding uses ``alloc_decode``; retraction and resumption the CPU
    copy; requests write KV. Requests with released SWA pages are freed with ``free``
    (``FREE_RELEASED_SWA``).
    """
    prealloc = {C.ALLOC} if config.page_size == 1 else {C.ALLOC_EXTEND, C.ALLOC_EXTEND_SWA_TAIL}
    return frozenset(prealloc | {C.ALLOC_DECODE, C.CPU_COPY, C.KV_BUFFER, C.FREE_RELEASED_SWA})


class DecodePreallocMachine(SWALockstep):
    """A decode node driven by the reference scheduler; allocations replayed on the implementation."""

    component = Component.DECODE_PREALLOC
    ghost_missing = ("its request table is the scheduler's, updated after all of a step's calls, so who holds what "
                     "after a divergence inside a step is not known (swa_allocator's suite shows the harm of the "
                     "same allocator calls)")

    def ghost(self) -> None:
        return None

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        self.decode_config: dp.DecodeConfig = binding.options.get("decode_config", DEFAULT_DECODE_CONFIG)
        self.node = dp.initial_node(self.decode_config)
        self.copies: dict[int, object] = {}  # the implementation's CPU copies of retracted requests

    # ------------------------------------------------------------ structural coverage

    @classmethod
    def structure(cls, config: PoolConfig, na: tuple[str, ...] = ()) -> dict[str, int]:
        """Arrivals of 1-3 requests and runs of 1-4 decode steps; several requests queued, admitted in one round,
        running and retracted at once; both pools exhausted and a decode step stalled on them; four resumptions in
        one example (the union over the default configs reaches each: one config alone need not)."""
        return {"arrive batch size": 3, "decode steps in a row": 4, "requests queued at once": 8,
                "requests admitted in one round": 3, "requests running at once": 4, "requests retracted at once": 3,
                "resume_retracted_reqs per example": 4, "full pool exhausted": 1, "swa pool exhausted": 1,
                "decode stalled": 1}

    def measure(self) -> dict[str, int]:
        node = self.node
        return {"requests queued at once": len(node.queue), "requests running at once": len(node.running),
                "requests retracted at once": len(node.retracted),
                "full pool exhausted": int(not self.ref.full.free_pages),
                "swa pool exhausted": int(not self.ref.swa.free_pages)}

    # ------------------------------------------------------------ rules

    @operation(environment=True, data=st.data())
    def arrive(self, data: Any) -> None:
        """A request prefilled elsewhere joins the queue (prompt lengths biased to page and window edges)."""
        p, w, top = self.p, self.w, self.config.size_full
        edges = sorted({x for x in (w - 1, w, w + 1, w + p - 1, w + p, w + p + 1, p - 1, p, p + 1, 2 * p + 1, 1)
                        if 1 <= x <= top})
        arrivals = data.draw(st.integers(1, 3), label="arrivals")
        self.note("arrive batch size", arrivals)
        for _ in range(arrivals):
            origin = data.draw(st.one_of(st.sampled_from(edges), st.integers(1, top)), label="origin_input_len")
            out = data.draw(st.sampled_from([1, 2]), label="output_len")
            max_new = data.draw(st.one_of(st.integers(out + 1, 4), st.integers(out + 1, 3 * p + w)),
                                label="max_new_tokens")
            rid = self._new_rid()
            self.node = dp.arrive(self.node, rid, origin, out, max_new)
            self.trace.op(f"arrive(request {rid}: prompt {origin}, outputs {out}, max_new_tokens {max_new})")

    @operation(needs=allocating_needs, environment=True, when=lambda self: self.node.queue)
    def pop_preallocated(self) -> None:
        """One admission round: budgets, gates, preallocation (D1 must hold)."""
        result = dp.pop_preallocated(self.node, self.ref)
        self.note("requests admitted in one round", len(result.rids))
        self._step("pop_preallocated", result)

    @operation(needs=allocating_needs, environment=True, when=lambda self: self.node.running, data=st.data())
    def decode(self, data: Any) -> None:
        """1-4 decode steps of the running batch in a row, as a scheduler runs them (each stalls, changing nothing,
        if the pools are short): consecutive steps are what fill the pools between admission rounds."""
        steps = data.draw(st.integers(1, 4), label="steps")
        self.note("decode steps in a row", steps)
        for _ in range(steps):
            if not self.node.running:
                return
            result = dp.decode(self.node, self.ref)
            self.note("decode stalled", int(result.stalled))
            self._step("decode", result)

    @operation(needs=allocating_needs, environment=True, when=lambda self: self.node.running, data=st.data())
    def retract(self, data: Any) -> None:
        """Retract 1-3 running requests to CPU copies, one after another (what the scheduler's ``retract_decode`` does
        when decode stalls: as many as the batch must give up). Several at once is what fills the retracted queue
        now that resumption keeps no "can finish" room (M1): one at a time, each was back before the next left."""
        running = [r.rid for r in self.node.running]
        rids = data.draw(st.lists(st.sampled_from(running), min_size=1, max_size=min(3, len(running)), unique=True),
                         label="requests")
        for rid in rids:
            self._step("retract", dp.retract(self.node, self.ref, rid))

    @operation(needs=allocating_needs, environment=True, when=lambda self: self.node.retracted)
    def resume_retracted_reqs(self) -> None:
        """Re-admit retracted requests and load their KV back (D1 must hold here too)."""
        self.count("resume_retracted_reqs per example")
        self._step("resume_retracted_reqs", dp.resume_retracted_reqs(self.node, self.ref))

    # ------------------------------------------------------------ replay of the scheduler's calls

    def _step(self, op: str, result: dp.StepResult) -> None:
        self.trace.op(f"{op}() -> requests {list(result.rids)}" + (" (stalled)" if result.stalled else ""))
        self.followed = None
        state = self.ref  # the reference allocator before each call: an admission's in-round reclaim reads it
        for call in result.calls:
            if op == "pop_preallocated" and call.op in _PRE_ALLOC_OPS:
                self._reclaim_in_round(call.rid, state)
            self._replay(call)
            state = call.after if call.after is not None else state
        # a stalled decode whose failed alloc_decode was followed (--accept F1) ends on the leaked state
        followed = self.followed
        self.ref = followed[1] if followed is not None and followed[0] is result.allocator else result.allocator
        self.node = result.node
        self.reqs = {r.rid: Req(r.rid, list(r.slots)) for r in self.node.running}
        if result.crash is not None:
            c = result.crash
            self.fail(f"D1 violated in {c.op}: request {c.rid} was admitted with budgets (full, swa) = "
                       f"{c.budgets} for requirements {c.required}, then its preallocation failed: {c.message} "
                       f"(upstream: AssertionError 'KV cache is full! Bug in memory estimation')")

    def _replay(self, call: dp.AllocatorCall) -> None:
        """Run one recorded reference call on the implementation; same outcome; bind what it returns."""
        impl_call, describe = self._impl_call(call)

        def reference() -> tuple[Any, Any]:
            if call.error is not None:
                raise call.error
            return None, call.result

        out = self.call(call.op, f"request {call.rid}: {describe}", reference, impl_call)
        if out is None:
            return
        if call.op == "get_cpu_copy":
            self.copies[call.rid] = out[1]
        elif call.result:
            self._bind(call, out[1])
        elif call.op in ("free", "free_swa") and call.after is not None:
            self.names.released(call.after)  # a later call of this step may hand the released pages out again

    def _bind(self, call: dp.AllocatorCall, got: Any) -> None:
        try:
            self.names.bind_full(call.op, list(call.result), [int(x) for x in got.reshape(-1).tolist()])
        except Divergence as err:
            self.fail(str(err))

    def _impl_call(self, call: dp.AllocatorCall) -> tuple[Callable[[], Any], str]:
        a, impl, side = call.args, self.impl, self._side
        if call.op == "alloc":
            return lambda: impl.alloc(a["need_size"]), f"need_size={a['need_size']}"
        if call.op in ("alloc_extend", "alloc_extend_swa_tail"):
            pre, seq, last = a["prefix_lens"], a["seq_lens"], side(a["last_loc"])
            extra = [a["swa_tail_len"]] if call.op == "alloc_extend_swa_tail" else []
            fn = getattr(impl, call.op)
            return (lambda: fn(self._t(pre), self._cpu(pre), self._t(seq), self._cpu(seq), self._t(last),
                               a["extend_num_tokens"], *extra),
                    f"{pre}->{seq}" + (f", swa_tail_len={extra[0]}" if extra else ""))
        if call.op == "alloc_decode":
            self.decoding = (a["seq_lens"], a["last_loc"])  # what a follower of a failed decode needs (swa suite)
            seq, last = a["seq_lens"], side(a["last_loc"])
            return lambda: impl.alloc_decode(self._t(seq), self._cpu(seq), self._t(last)), f"seq_lens={seq}"
        if call.op in ("free", "free_swa"):
            idx = side(a["free_index"])
            return lambda: getattr(impl, call.op)(self._t(idx)), f"{len(idx)} slots"
        if call.op == "get_cpu_copy":
            idx = side(a["indices"])
            return lambda: impl.get_cpu_copy(self._t(idx)), f"{len(idx)} positions"
        if call.op == "load_cpu_copy":
            return (lambda: impl.load_cpu_copy(self.copies.pop(call.rid), self._t(side(a["indices"]))),
                    f"{len(a['indices'])} positions")
        if call.op == "set_kv_buffer":
            return self._kv_call(a), f"layer {a['layer_id']}, {len(a['loc'])} tokens"
        raise HarnessBug(f"the decode node made a call the harness cannot replay: {call.op}")

    def _side(self, ref_slots: list[int]) -> list[int]:
        return [self.names.impl_slot(s) if s > 0 else s for s in ref_slots]

    def _kv_call(self, a: dict[str, Any]) -> Callable[[], Any]:
        geo = self.config.kv
        shape = (len(a["loc"]), geo.head_num, geo.head_dim)
        pool = self.impl.get_kvcache()
        dtype, dev = pool.get_kv_buffer(0)[0].dtype, self.impl.device
        k = torch.tensor(a["cache_k"], dtype=dtype, device=dev).reshape(shape)
        v = torch.tensor(a["cache_v"], dtype=dtype, device=dev).reshape(shape)
        loc = self._side(a["loc"])
        return lambda: pool.set_kv_buffer(a["layer_id"], self._t(loc), k, v)

    # ------------------------------------------------------------ node invariants

    @check_after_each_step
    def node_invariants_hold(self) -> None:
        """No leak, D3 residency, and every running request's KV is what was written for it."""
        try:
            dp.check_node(self.node, self.ref)
        except InvariantViolation as err:
            self.fail(str(err))
        if self.decode_config.write_kv:
            self._check_kv()

    @check_after_each_step
    def decode_budgets_agree(self) -> None:
        """Capability ``DECODE_BUDGETS``: the engine's own preallocation-queue functions, on its pools as they stand
        after this step, give the reference's per-request lengths and requirements and the budgets of the next
        admission round (§2.3-§2.5; the requirements and budgets as the corrected policy has them, R4: 0.5.23
        page-rounds them); and, per queued and retracted request, the same admission decisions: the reservation
        test of ``pop_preallocated`` / ``resume_retracted_reqs`` and the SWA reclaim before its preallocation (0.5.23's
        ``reclaim_for_prealloc``, extending §2.5; nothing is evictable on this node). The reclaim is also compared
        inside each admission round, right before an admitted request's preallocation (``_reclaim_in_round``)."""
        if not self.supports(C.DECODE_BUDGETS):
            return
        node = self.node.model_copy(update={"config": self.node.config.model_copy(
            update={"policy": dp.PreallocPolicy.CORRECTED})})
        reqs = [*node.running, *node.retracted, *node.queue]
        shape = [(r.origin_input_len, r.output_len, r.max_new_tokens) for r in reqs]
        n_run, n_ret = len(node.running), len(node.retracted)
        got = self.query("decode_budgets()", lambda impl: impl.decode_budgets(
            shape[:n_run], shape[n_run:n_run + n_ret], shape[n_run + n_ret:],
            reserved_decode_tokens=node.config.reserved_decode_tokens, sliding_window_size=self.w))
        if got["clip"] != node.config.clip_max_new_tokens:
            raise HarnessBug(f"the implementation's CLIP is {got['clip']}, the decode config's "
                             f"{node.config.clip_max_new_tokens}: run with --policy and a matching decode config")
        budgets = dp.allocatable_token_budgets(node, self.ref)
        want_budgets = (budgets.full, budgets.swa)
        want: list[dict[str, Any]] = [
            {"fill_len": dp.fill_len(r), "swa_tail_len": dp.swa_tail_len(node, self.ref, dp.fill_len(r)),
             "swa_retractable_len": dp.swa_retractable_len(node, self.ref, r),
             "prealloc_kv_lens": dp.prealloc_kv_lens(node, self.ref, r),
             "prealloc_required_tokens": dp.prealloc_required_tokens(node, self.ref, r)} for r in reqs]
        if tuple(got["budgets"]) != want_budgets:
            self.fail(f"decode budgets (full, swa) = {tuple(got['budgets'])}, reference {want_budgets} "
                      f"({n_run} running, {n_ret} retracted)", check="budget",
                      detail={"implementation": list(got["budgets"]), "reference": list(want_budgets)})
        for req, mine, theirs in zip(reqs, want, got["requests"], strict=True):
            for key, value in mine.items():
                if (tuple(theirs[key]) if isinstance(value, tuple) else theirs[key]) != value:
                    self.fail(f"{key} of request {req.rid} (prompt {req.origin_input_len}, outputs "
                              f"{req.output_len}) = {theirs[key]}, reference {value}", check="budget",
                              detail={"function": key, "implementation": theirs[key], "reference": value})
        # the resume round keeps no "can finish" room (SGLang passes no retractable counts: M1)
        resume = dp.allocatable_token_budgets(node, self.ref, count_retracted=False, reserve_finish=False)
        for i, (req, theirs) in enumerate(zip(reqs, got["requests"], strict=True)):
            if i >= n_run + n_ret:
                self._decision_agrees(node, req, theirs, "pop_preallocated", budgets,
                                      dp.admission_gate(node, self.ref, budgets, req),
                                      dp.admission_reclaims_swa(node, self.ref))
            elif i >= n_run:
                self._decision_agrees(node, req, theirs, "resume_retracted_reqs", resume,
                                      dp.resume_gate(node, self.ref, resume, req),
                                      dp.resume_reclaims_swa(node, self.ref))

    def _decision_agrees(self, node: dp.DecodeNode, req: dp.DecodeRequest, theirs: dict[str, Any], round_op: str,
                         budgets: dp.Budgets, gate: dp.Gate, reclaims: bool) -> None:
        """One queued (``pop_preallocated``) or retracted (``resume_retracted_reqs``) request: the engine's reservation
        test against the round's budgets, whether it reclaims SWA room for the request's tail, and what the reclaim
        finds (ready, or its shortfall: the page-rounded tail needed, the SWA tokens available with nothing
        evictable), against the reference's gate and :func:`~kvproof.reference.decode_prealloc.reclaim_swa_tail`."""
        who = (f"request {req.rid} (prompt {req.origin_input_len}, outputs {req.output_len}, max_new_tokens "
               f"{req.max_new_tokens}) in {round_op}, after step {len(self.trace)} ({self._last_rule()})")
        fits = bool(theirs["reservation_fits"])
        if fits != gate.admit:
            self.fail(f"the reservation test {'admits' if fits else 'refuses'} {who}; the reference "
                      f"{'admits' if gate.admit else 'refuses: ' + gate.reason} (budgets (full, swa) = "
                      f"({budgets.full}, {budgets.swa}), requirements ({gate.full_required}, {gate.swa_required}))",
                      check="reservation", detail={"round": round_op, "implementation": fits, "reference": gate.admit,
                                                   "budgets": [budgets.full, budgets.swa]})
        self._reclaim_agrees(node, self.ref, req, theirs, round_op, who, reclaims)

    def _last_rule(self) -> str:
        steps = [step[0].split("(", 1)[0] for step in self.trace.steps if step]
        return steps[-1] if steps else "no step yet"

    def _reclaim_in_round(self, rid: int, state: ref.SWAAllocatorState) -> None:
        """0.5.23 reclaims SWA room for an admitted request right before its ``_pre_alloc``, after the round's earlier
        admissions: the engine's reclaim on its pools at that moment (this call not yet replayed) against the
        reference's on ``state``, the reference allocator at the same point of the round."""
        if not self.supports(C.DECODE_BUDGETS):
            return
        (req,) = [r for r in self.node.queue if r.rid == rid]
        shape = (req.origin_input_len, req.output_len, req.max_new_tokens)
        got = self.query("decode_budgets()", lambda impl: impl.decode_budgets(
            [], [], [shape], reserved_decode_tokens=self.node.config.reserved_decode_tokens,
            sliding_window_size=self.w))
        (theirs,) = got["requests"]
        who = (f"request {req.rid} (prompt {req.origin_input_len}, outputs {req.output_len}, max_new_tokens "
               f"{req.max_new_tokens}) in pop_preallocated, before its preallocation")
        self._reclaim_agrees(self.node, state, req, theirs, "pop_preallocated", who,
                             dp.admission_reclaims_swa(self.node, state))

    def _reclaim_agrees(self, node: dp.DecodeNode, state: ref.SWAAllocatorState, req: dp.DecodeRequest,
                        theirs: dict[str, Any],
                        round_op: str, who: str, reclaims: bool) -> None:
        """Whether the engine reclaims SWA room for ``req`` as the reference says, and what the reclaim finds."""
        if bool(theirs["reclaim_called"]) != reclaims:
            self.fail(f"the implementation {'reclaims' if theirs['reclaim_called'] else 'does not reclaim'} SWA room "
                      f"for {who}; the reference {'does' if reclaims else 'does not'}", check="reclaim",
                      detail={"round": round_op, "implementation": bool(theirs["reclaim_called"]),
                              "reference": reclaims})
        if not reclaims:
            return
        want = dp.reclaim_swa_tail(node, state, req)
        got = theirs["reclaim"]
        mine = None if want.ready else (want.needed, want.available)
        their = None if got is None else (got["needed"], got["available"])
        if their != mine:
            def say(x: tuple[int, int] | None) -> str:
                return "ready" if x is None else f"short (needed {x[0]}, available {x[1]})"
            self.fail(f"reclaim_for_prealloc for {who}: implementation {say(their)}, reference {say(mine)} "
                      f"(page-rounded SWA tail {want.needed}, {want.available} SWA tokens free, nothing evictable)",
                      check="reclaim", detail={"round": round_op, "implementation": their, "reference": mine})

    def _check_kv(self) -> None:
        geo, m = self.config.kv, self.ref.full_to_swa_index_mapping
        for req in self.node.running:
            length = len(req.slots)
            for j, f in enumerate(req.slots):
                for layer in range(geo.num_layers):
                    k, v = dp.token_row(req.rid, j, layer, geo.row_width)
                    swa = geo.is_swa_layer(layer)
                    if swa and j < length - self.w:
                        continue  # only in-window SWA rows must survive
                    if swa and m[f] == 0:
                        self.fail(f"request {req.rid} has no SWA slot for in-window position {j} (L={length})")
                    (got,) = ref.kv_rows(self.ref, layer, [m[f] if swa else f])
                    if got != tuple(k + v):
                        kind = "SWA" if swa else "full"
                        self.fail(f"request {req.rid} lost the {kind} KV of position {j} (layer {layer}): "
                                   f"reference holds {got}")



#: the allocator call of ``_pre_alloc`` (P == 1; P > 1 without tail mode; tail mode)
_PRE_ALLOC_OPS = ("alloc", "alloc_extend", "alloc_extend_swa_tail")

#: The conformance default: the corrected policy (D1 holds, so a failure is the allocator's), R = 0 (tight).
DEFAULT_DECODE_CONFIG = dp.DecodeConfig(reserved_decode_tokens=0, policy=dp.PreallocPolicy.CORRECTED)


def _policy(value: str) -> dict[str, Any]:
    return {"decode_config": DEFAULT_DECODE_CONFIG.model_copy(update={"policy": dp.PreallocPolicy(value)})}


SUITE = Suite(DecodePreallocMachine, CONFORMANCE_CONFIGS, option_types={"decode_config": dp.DecodeConfig},
              apply={"policy": _policy})

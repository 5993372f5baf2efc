"""``decode_prealloc``: a PD decode node's preallocation with separate full / SWA budgets (sglang_semantics.md §2).

Models ``DecodePreallocQueue`` of PR #24857 (+ #25805): requests prefilled elsewhere
wait in a queue; each scheduling round (:func:`pop_preallocated`) admits them in
order while a *full* and an *SWA* budget allow (§2.4, §2.5), and ``_pre_alloc``
(§2.6) then preallocates their KV -- the whole prompt in the full pool, only the
page-aligned window tail in the SWA pool (``alloc_extend_swa_tail``, §2.7). Running
requests decode one token per step and release out-of-window SWA pages
(``_evict_swa``, §1.6); under memory pressure they are retracted to a CPU copy and
later resumed (:func:`resume_retracted_reqs`) with ``load_cpu_copy`` (§2.8).
0.5.23 reclaims SWA room for a request's tail before preallocating it
(``reclaim_for_prealloc``): :func:`reclaim_swa_tail` says what that finds on a node
without a prefix cache (the page-rounded tail against the free SWA tokens), and
:func:`admission_reclaims_swa` / :func:`resume_reclaims_swa` for whom it is asked.

The upstream policy and the corrected one are two values of one typed parameter,
:class:`PreallocPolicy`:

* ``UPSTREAM`` (PR era): requirements are not page-rounded, and within a round the SWA
  budget (and, on resume, both budgets) is decremented by the unrounded requirement
  instead of being recomputed (R4). ``_pre_alloc`` then *asserts* success: an admitted
  request can crash the node (S2, the violation of D1).
* ``CORRECTED`` (0.5.23's ``ceil_align``, #33794): requirements are page-rounded and
  both budgets are recomputed from the pools after every admission, so D1 holds
  (proved in ``kvproof.spec.decode_prealloc``).

Functional core: every operation takes the node and the allocator state (frozen
values) and returns new ones plus the exact sequence of allocator calls it made
(:class:`AllocatorCall`), so a lockstep harness can replay them on any
implementation. A failed preallocation of an admitted request is returned as a
:class:`Crash` (upstream: ``AssertionError: KV cache is full! Bug in memory
estimation``), never raised. Invalid input raises ``InvalidOperation`` and changes
nothing. Transfers complete at once: a preallocated request is running, its prompt
KV written (full rows of every position, SWA rows of its tail).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvproof.reference import swa_allocator as sa
from kvproof.reference.arith import ceil_p, floor_p
from kvproof.reference.arith import swa_tail_len as _tail
from kvproof.reference.config import ConfigModel
from kvproof.reference.errors import OutOfMemory, ensure, require
from kvproof.reference.paged import LEAKED

__all__ = [
    "AllocatorCall",
    "Budgets",
    "Crash",
    "DecodeConfig",
    "DecodeNode",
    "DecodeRequest",
    "Gate",
    "PreallocPolicy",
    "RetractedRequest",
    "RunningRequest",
    "SWAReclaim",
    "StepResult",
    "admission_gate",
    "admission_reclaims_swa",
    "allocatable_token_budgets",
    "arrive",
    "check_node",
    "decode",
    "fill_len",
    "initial_node",
    "need_space_for_single_req",
    "pop_preallocated",
    "prealloc_kv_lens",
    "prealloc_required_tokens",
    "reclaim_swa_tail",
    "resume_gate",
    "resume_reclaims_swa",
    "resume_retracted_reqs",
    "retract",
    "swa_retractable_len",
    "swa_tail_len",
    "token_row",
    "uses_tail",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class PreallocPolicy(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """How requirements are rounded and budgets refreshed between admissions."""

    UPSTREAM = "upstream"  # PR #24857: unrounded, SWA budget decremented (R4, S2)
    CORRECTED = "corrected"  # page-rounded requirements, budgets recomputed from the pools


class DecodeConfig(ConfigModel):
    """The decode node's knobs (§1.1): R, CLIP, the policy, and whether tail preallocation is on."""

    model_config = _FROZEN

    reserved_decode_tokens: int = Field(default=512, ge=0, description="R: per-request decode headroom")
    clip_max_new_tokens: int = Field(default=4096, ge=1, description="CLIP for max_new_tokens estimates")
    policy: PreallocPolicy = PreallocPolicy.UPSTREAM
    swa_tail_prealloc: bool = True  # SWA tail preallocation (effective at page size > 1, §2.3 uses_tail)
    write_kv: bool = True  # write the transferred / decoded KV rows (off: capacity studies)


class DecodeRequest(BaseModel):
    """A request waiting for preallocation: prompt length, outputs so far, output limit."""

    model_config = _FROZEN

    rid: int
    origin_input_len: int
    output_len: int
    max_new_tokens: int


class RunningRequest(DecodeRequest):
    """A preallocated request: the full slot of each KV position and its SWA eviction mark."""

    slots: tuple[int, ...]
    swa_evicted_seqlen: int


class RetractedRequest(DecodeRequest):
    """A retracted request: its KV on the CPU (positions ``0..len(slots)-1`` at retraction)."""

    kv: sa.KVCpuCopy
    length: int


class DecodeNode(BaseModel):
    """The scheduler's view: the prealloc queue, running requests, retracted requests."""

    model_config = _FROZEN

    config: DecodeConfig
    queue: tuple[DecodeRequest, ...] = ()
    running: tuple[RunningRequest, ...] = ()
    retracted: tuple[RetractedRequest, ...] = ()


class AllocatorCall(BaseModel):
    """One allocator operation the node made, with its outcome (for replay on an implementation).

    ``error`` is the reference's own :class:`OutOfMemory` when the call failed (its op,
    pool and page counts), ``None`` when it succeeded; ``result`` the slots it returned.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    op: str
    rid: int
    args: dict[str, Any]
    error: OutOfMemory | None = None
    result: tuple[int, ...] = ()
    #: the allocator right after a successful transition (``None`` for queries and failures): a harness that
    #: replays a step's calls follows the pages each release gives back before a later call of the same step
    #: hands them out again
    after: sa.SWAAllocatorState | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Crash(BaseModel):
    """D1 violated: an admitted request's preallocation failed (upstream asserts and dies)."""

    model_config = _FROZEN

    rid: int
    op: str
    budgets: tuple[int, int | None]
    required: tuple[int, int]
    message: str


class Budgets(BaseModel):
    """``(full_allocatable_tokens, swa_allocatable_tokens)``; ``swa`` is None without tail preallocation."""

    model_config = _FROZEN

    full: int
    swa: int | None


class Gate(BaseModel):
    """The admission decision for one request (§2.5 step 6) and the requirements it used."""

    model_config = _FROZEN

    admit: bool
    full_required: int
    swa_required: int
    reason: str = ""


class StepResult(BaseModel):
    """What a node operation returns: the new node and allocator, its calls, whom it touched, and a crash."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    node: DecodeNode
    allocator: sa.SWAAllocatorState
    calls: tuple[AllocatorCall, ...] = ()
    rids: tuple[int, ...] = ()
    crash: Crash | None = None
    stalled: bool = False  # decode: the pools could not take the batch (nothing changed; retract next)


# ---------------------------------------------------------------- construction and arrivals


def initial_node(config: DecodeConfig | None = None) -> DecodeNode:
    return DecodeNode(config=config or DecodeConfig())


def arrive(node: DecodeNode, rid: int, origin_input_len: int, output_len: int, max_new_tokens: int) -> DecodeNode:
    """A prefilled request joins the prealloc queue (validated: nothing changes on bad input)."""
    op = "arrive"
    require(origin_input_len >= 1, op, "origin_input_len", f"must be >= 1, got {origin_input_len}")
    # PD: the prefill node produced the first token, so KV positions = prompt + outputs - 1
    require(output_len >= 1, op, "output_len", f"must be >= 1 (the prefill's first token), got {output_len}")
    require(max_new_tokens >= 1, op, "max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    # a request that already produced all its tokens never reaches the decode node
    require(output_len < max_new_tokens, op, "output_len", f"{output_len} outputs leave nothing to decode "
            f"under max_new_tokens {max_new_tokens}")
    known = {r.rid for r in (*node.queue, *node.running, *node.retracted)}
    # a request id is queued, preallocated or retracted at most once
    require(rid not in known, op, "rid", f"request {rid} is already on this node")
    req = DecodeRequest(rid=rid, origin_input_len=origin_input_len, output_len=output_len,
                        max_new_tokens=max_new_tokens)
    return node.model_copy(update={"queue": (*node.queue, req)})


# ---------------------------------------------------------------- pure helpers (§2.3)


def fill_len(req: DecodeRequest) -> int:
    """``A(req) = len(origin) + max(len(output) - 1, 0)``: KV positions when (re)entering decode."""
    return req.origin_input_len + max(req.output_len - 1, 0)


def uses_tail(node: DecodeNode, allocator: sa.SWAAllocatorState) -> bool:
    """Tail preallocation is on and the pools are paged (``_uses_swa_tail_prealloc``)."""
    return node.config.swa_tail_prealloc and allocator.config.page_size > 1


def swa_tail_len(node: DecodeNode, allocator: sa.SWAAllocatorState, length: int) -> int:
    """``_swa_tail_len``: the page-aligned window tail, or the whole length without tail mode."""
    if not uses_tail(node, allocator) or length <= 0:
        return max(length, 0)
    return _tail(length, allocator.config.sliding_window_size, allocator.config.page_size)


def swa_retractable_len(node: DecodeNode, allocator: sa.SWAAllocatorState, req: DecodeRequest) -> int:
    """SWA tokens a running request would give back if retracted (ignores eviction: R10)."""
    if uses_tail(node, allocator):
        return swa_tail_len(node, allocator, req.origin_input_len) + req.output_len
    return req.origin_input_len + req.output_len


def prealloc_kv_lens(node: DecodeNode, allocator: sa.SWAAllocatorState, req: DecodeRequest) -> tuple[int, int]:
    """``(full_len, swa_len)`` to preallocate."""
    a = fill_len(req)
    return a, swa_tail_len(node, allocator, a)


def prealloc_required_tokens(node: DecodeNode, allocator: sa.SWAAllocatorState,
                             req: DecodeRequest) -> tuple[int, int]:
    """``(full, swa)`` requirements: lengths plus R, page-rounded under ``CORRECTED`` only (R4)."""
    full, swa = prealloc_kv_lens(node, allocator, req)
    if node.config.policy is PreallocPolicy.CORRECTED:
        p = allocator.config.page_size
        full, swa = ceil_p(full, p), ceil_p(swa, p)
    r = node.config.reserved_decode_tokens
    return full + r, swa + r


def _clipped(node: DecodeNode, req: DecodeRequest) -> int:
    return min(req.max_new_tokens, node.config.clip_max_new_tokens)


def need_space_for_single_req(node: DecodeNode, retractable: int) -> int:
    """Room for one running request to finish if all others are retracted (0 without running)."""
    if not node.running:
        return 0
    return max(_clipped(node, r) + r.origin_input_len - retractable for r in node.running)


# ---------------------------------------------------------------- budgets (§2.4)


def allocatable_token_budgets(node: DecodeNode, allocator: sa.SWAAllocatorState, *, count_retracted: bool = True,
                              extra_reserved_reqs: int = 0, reserve_finish: bool = True) -> Budgets:
    """Both budgets from the pools' free space, the reservations and the retracted queue.

    ``reserve_finish``: whether the budgets keep the "one running request can finish" room (``need``, ``need_swa``;
    SGLang's ``pop_preallocated`` passes the retractable counts they are computed from). SGLang's
    ``resume_retracted_reqs`` passes none, so its ``_need_space_for_single_req(None)`` is 0 and only ``R`` per active
    request is reserved (the PR era and 0.5.23 alike): ``reserve_finish=False`` is that budget, the one this
    module's :func:`resume_retracted_reqs` uses. sglang_semantics.md §2.5 says "the same budgets"; the code passes
    no retractable counts (model gap M1 in docs/sglang-findings.md).
    """
    tail = uses_tail(node, allocator)
    retractable = sum(r.origin_input_len + r.output_len for r in node.running)
    n_active = len(node.running) + extra_reserved_reqs
    reserved = node.config.reserved_decode_tokens * n_active
    need = need_space_for_single_req(node, retractable) if reserve_finish else 0
    available = sa.full_available_size(allocator) if tail else sa.available_size(allocator)
    full = available - max(reserved, need)
    if count_retracted:
        full -= sum(prealloc_required_tokens(node, allocator, r)[0] for r in node.retracted)
    if not tail:
        return Budgets(full=full, swa=None)
    retractable_swa = sum(swa_retractable_len(node, allocator, r) for r in node.running)
    need_swa = max((swa_tail_len(node, allocator, r.origin_input_len) + _clipped(node, r) - retractable_swa
                    for r in node.running), default=need) if reserve_finish else 0
    swa_available = sa.swa_available_size(allocator)
    swa_used = allocator.config.size_swa - swa_available
    growth = max(0, n_active * allocator.config.sliding_window_size - swa_used)
    swa = swa_available - max(min(reserved, growth), need_swa)
    if count_retracted:
        swa -= sum(prealloc_required_tokens(node, allocator, r)[1] for r in node.retracted)
    return Budgets(full=full, swa=swa)


def admission_gate(node: DecodeNode, allocator: sa.SWAAllocatorState, budgets: Budgets,
                   req: DecodeRequest) -> Gate:
    """The full gate and (tail mode) the SWA gate of §2.5 step 6, with their "can finish" clauses."""
    full_req, swa_req = prealloc_required_tokens(node, allocator, req)
    retractable = sum(r.origin_input_len + r.output_len for r in node.running)
    full_need = max(full_req, req.origin_input_len + _clipped(node, req) - retractable)
    if full_need > budgets.full:
        return Gate(admit=False, full_required=full_req, swa_required=swa_req,
                    reason=f"full gate: needs {full_need} > budget {budgets.full}")
    if budgets.swa is not None:
        retractable_swa = sum(swa_retractable_len(node, allocator, r) for r in node.running)
        swa_len = prealloc_kv_lens(node, allocator, req)[1]
        swa_need = max(swa_req, swa_len + _clipped(node, req) - retractable_swa)
        if swa_need > budgets.swa:
            return Gate(admit=False, full_required=full_req, swa_required=swa_req,
                        reason=f"SWA gate: needs {swa_need} > budget {budgets.swa}")
    return Gate(admit=True, full_required=full_req, swa_required=swa_req)


def resume_gate(node: DecodeNode, allocator: sa.SWAAllocatorState, budgets: Budgets, req: DecodeRequest) -> Gate:
    """The resumption gate of :func:`resume_retracted_reqs` (§2.5, last paragraph): both requirements within the
    budgets (the SWA one in tail mode only), no "can finish" clause."""
    full_req, swa_req = prealloc_required_tokens(node, allocator, req)
    if full_req > budgets.full:
        return Gate(admit=False, full_required=full_req, swa_required=swa_req,
                    reason=f"full gate: needs {full_req} > budget {budgets.full}")
    if budgets.swa is not None and swa_req > budgets.swa:
        return Gate(admit=False, full_required=full_req, swa_required=swa_req,
                    reason=f"SWA gate: needs {swa_req} > budget {budgets.swa}")
    return Gate(admit=True, full_required=full_req, swa_required=swa_req)


# ---------------------------------------------------------------- SWA reclaim before a preallocation (0.5.23)


class SWAReclaim(BaseModel):
    """Reclaiming SWA room for one request's tail before its preallocation (0.5.23, extending §2.5 step 6).

    ``needed`` is the page-rounded SWA tail ``ceil_P(swa_tail_len(A))``; ``available`` the SWA pool's free tokens
    after evicting what a prefix cache could give back -- nothing: the decode node modelled here has no prefix cache
    (§2.4 note), so it is the pool's free SWA tokens as they stand. The reclaim is *ready* when the tail fits.
    """

    model_config = _FROZEN

    needed: int
    available: int

    @property
    def ready(self) -> bool:
        return self.needed <= self.available


def admission_reclaims_swa(node: DecodeNode, allocator: sa.SWAAllocatorState) -> bool:
    """Whether admitting a queued request reclaims SWA room for its tail first (after both gates pass, before
    ``_pre_alloc``): in tail mode, where the round has an SWA budget. 0.5.23 aborts the request (it leaves the queue,
    the round goes on) when the reclaim falls short; under ``CORRECTED`` it never does, since the SWA gate's
    requirement is at least the page-rounded tail and the SWA budget at most the free SWA tokens."""
    return uses_tail(node, allocator)


def resume_reclaims_swa(node: DecodeNode, allocator: sa.SWAAllocatorState) -> bool:
    """Whether resuming a retracted request reclaims SWA room first: never with separate full and SWA pools (the
    reservation's SWA budget already prices what could be reclaimed; only a pool cutting both sides from one buffer
    reclaims there) and no prefix cache on the node (``_pre_alloc`` reclaims only with a decode radix cache)."""
    return False


def reclaim_swa_tail(node: DecodeNode, allocator: sa.SWAAllocatorState, req: DecodeRequest) -> SWAReclaim:
    """What reclaiming SWA room for ``req``'s preallocation finds now: its page-rounded tail against the free SWA
    tokens (nothing is evictable). Page-rounded under either policy: it prices the pages ``alloc_extend_swa_tail``
    takes, not a budget requirement."""
    swa = prealloc_kv_lens(node, allocator, req)[1]
    return SWAReclaim(needed=ceil_p(swa, allocator.config.page_size), available=sa.swa_available_size(allocator))


def _refresh(node: DecodeNode, allocator: sa.SWAAllocatorState, budgets: Budgets, gate: Gate, admitted: int, *,
             count_retracted: bool, decrement_full: bool) -> Budgets:
    """Budgets after one admission: recomputed (CORRECTED) or decremented by the unrounded need (UPSTREAM); the
    resume round's (``count_retracted=False``) keep no "can finish" room (M1)."""
    fresh = allocatable_token_budgets(node, allocator, count_retracted=count_retracted,
                                      extra_reserved_reqs=admitted + 1, reserve_finish=count_retracted)
    if node.config.policy is PreallocPolicy.CORRECTED:
        return fresh
    full = budgets.full - gate.full_required if decrement_full else fresh.full
    swa = None if budgets.swa is None else budgets.swa - gate.swa_required
    return Budgets(full=full, swa=swa)


# ---------------------------------------------------------------- allocator calls


def token_row(rid: int, position: int, layer_id: int, width: int) -> tuple[list[float], list[float]]:
    """The K and V row of a token (small integers: exact in bfloat16), so any run can check its KV."""
    k = [float((rid * 31 + position * 7 + layer_id * 3 + j) % 251 - 125) for j in range(width)]
    v = [float((rid * 17 + position * 5 + layer_id * 11 + j) % 241 - 120) for j in range(width)]
    return k, v


class _Calls:
    """Runs allocator operations on the reference state and records them (the node's effect log)."""

    def __init__(self, state: sa.SWAAllocatorState) -> None:
        self.state = state
        self.calls: list[AllocatorCall] = []

    def run(self, op: str, rid: int, args: dict[str, Any]) -> tuple[int, ...]:
        """``sa.<op>(state, **args)``, a transition: the new state is kept, the slots it handed out returned."""
        out = self._call(op, rid, args)
        state, result = out if isinstance(out, tuple) else (out, ())
        self.state = state
        self.calls.append(AllocatorCall(op=op, rid=rid, args=args, result=tuple(result), after=state))
        return tuple(result)

    def get_cpu_copy(self, rid: int, indices: list[int]) -> sa.KVCpuCopy:
        """``sa.get_cpu_copy``, a query: the state stays, the copy is returned."""
        args: dict[str, Any] = {"indices": indices}
        copy: sa.KVCpuCopy = self._call("get_cpu_copy", rid, args)
        self.calls.append(AllocatorCall(op="get_cpu_copy", rid=rid, args=args))
        return copy

    def _call(self, op: str, rid: int, args: dict[str, Any]) -> Any:
        """Run ``sa.<op>``; a failure is recorded with the reference's own error, then raised."""
        try:
            return getattr(sa, op)(self.state, **args)
        except OutOfMemory as err:
            self.calls.append(AllocatorCall(op=op, rid=rid, args=args, error=err))
            raise

    def write(self, rid: int, slots: Sequence[int], positions: Sequence[int], node: DecodeNode) -> None:
        """The KV rows of ``positions`` of request ``rid``, every layer (full at slots, SWA through M)."""
        geo = self.state.config.kv
        if not node.config.write_kv or not slots:
            return
        for layer in range(geo.num_layers):
            rows = [token_row(rid, pos, layer, geo.row_width) for pos in positions]
            self.run("set_kv_buffer", rid, {"layer_id": layer, "loc": list(slots), "cache_k": [k for k, _ in rows],
                                            "cache_v": [v for _, v in rows]})


def _pre_alloc(node: DecodeNode, calls: _Calls, req: DecodeRequest) -> tuple[int, ...]:
    """``_pre_alloc`` (§2.6): the whole fill in the full pool; its tail (tail mode) or all of it in the SWA pool."""
    a, state = fill_len(req), calls.state
    if state.config.page_size == 1:
        return calls.run("alloc", req.rid, {"need_size": a, "owner": req.rid})
    args: dict[str, Any] = {"prefix_lens": [0], "seq_lens": [a], "last_loc": [-1], "extend_num_tokens": a,
                            "owners": [req.rid]}
    if uses_tail(node, state):
        args["swa_tail_len"] = swa_tail_len(node, state, a)
        return calls.run("alloc_extend_swa_tail", req.rid, args)
    return calls.run("alloc_extend", req.rid, args)


def _start(node: DecodeNode, calls: _Calls, req: DecodeRequest, slots: tuple[int, ...]) -> RunningRequest:
    """The request runs with its preallocated slots; 0.5.23 marks the non-tail prefix evicted (#28085, R6)."""
    a = fill_len(req)
    evicted = a - swa_tail_len(node, calls.state, a) if uses_tail(node, calls.state) else 0
    fields = req.model_dump(include=set(DecodeRequest.model_fields))
    return RunningRequest(**fields, slots=slots, swa_evicted_seqlen=evicted)


# ---------------------------------------------------------------- scheduling rounds


def pop_preallocated(node: DecodeNode, allocator: sa.SWAAllocatorState) -> StepResult:
    """One round (§2.5): admit queued requests in order while both gates pass; preallocate each.

    Head-of-line: the first request that fails a gate stops the round. An admitted
    request whose preallocation fails is a :class:`Crash` (D1) and ends the round.
    """
    calls, start = _Calls(allocator), node
    budgets = allocatable_token_budgets(node, allocator, count_retracted=True)
    running, admitted = list(node.running), list[int]()
    for req in node.queue:
        gate = admission_gate(start, allocator, budgets, req)
        if not gate.admit:
            break
        try:
            slots = _pre_alloc(node, calls, req)
        except OutOfMemory as err:
            crash = Crash(rid=req.rid, op="pop_preallocated", budgets=(budgets.full, budgets.swa),
                          required=(gate.full_required, gate.swa_required), message=str(err))
            return _finish(node, calls, running, admitted, crash)
        run = _start(node, calls, req, slots)
        calls.write(req.rid, slots, range(len(slots)), node)  # the transfer from the prefill node
        running.append(run)
        admitted.append(req.rid)
        budgets = _refresh(start, calls.state, budgets, gate, len(admitted) - 1, count_retracted=True,
                           decrement_full=False)
    return _finish(node, calls, running, admitted, None)


def _finish(node: DecodeNode, calls: _Calls, running: list[RunningRequest], admitted: list[int],
            crash: Crash | None) -> StepResult:
    queue = tuple(r for r in node.queue if r.rid not in admitted)
    new = node.model_copy(update={"queue": queue, "running": tuple(running)})
    return StepResult(node=new, allocator=calls.state, calls=tuple(calls.calls), rids=tuple(admitted), crash=crash)


def decode(node: DecodeNode, allocator: sa.SWAAllocatorState) -> StepResult:
    """One decode step of every running request: a slot for its next token, its KV, window eviction, finishing.

    All-or-nothing on the allocation: if the pools cannot take the batch, nothing changes
    and the result is ``stalled`` (the scheduler then retracts a request).
    """
    if not node.running:
        return StepResult(node=node, allocator=allocator)
    calls = _Calls(allocator)
    seqs = [len(r.slots) + 1 for r in node.running]
    try:
        new = calls.run("alloc_decode", -1, {"seq_lens": seqs, "last_loc": [r.slots[-1] for r in node.running],
                                             "owners": [r.rid for r in node.running]})
    except OutOfMemory:
        return StepResult(node=node, allocator=allocator, calls=tuple(calls.calls), stalled=True)
    running, finished = [], []
    for req, slot in zip(node.running, new, strict=True):
        req = req.model_copy(update={"slots": (*req.slots, slot), "output_len": req.output_len + 1})
        calls.write(req.rid, [slot], [len(req.slots) - 1], node)
        req = _evict_swa(node, calls, req)
        if req.output_len >= req.max_new_tokens:
            calls.run("free", req.rid, {"free_index": list(req.slots)})
            finished.append(req.rid)
        else:
            running.append(req)
    done = node.model_copy(update={"running": tuple(running)})
    return StepResult(node=done, allocator=calls.state, calls=tuple(calls.calls), rids=tuple(finished))


def _evict_swa(node: DecodeNode, calls: _Calls, req: RunningRequest) -> RunningRequest:
    """``_evict_swa`` (§1.6, every step): release SWA pages before ``floor_P(L - 1 - W - P)``."""
    p, w = calls.state.config.page_size, calls.state.config.sliding_window_size
    new = floor_p(max(req.swa_evicted_seqlen, len(req.slots) - 1 - w - p), p)
    if new <= req.swa_evicted_seqlen:
        return req
    calls.run("free_swa", req.rid, {"free_index": list(req.slots[req.swa_evicted_seqlen:new])})
    return req.model_copy(update={"swa_evicted_seqlen": new})


def retract(node: DecodeNode, allocator: sa.SWAAllocatorState, rid: int) -> StepResult:
    """Copy a running request's KV to the CPU, free its slots, queue it for resumption (§1.6)."""
    op = "retract"
    found = [r for r in node.running if r.rid == rid]
    require(bool(found), op, "rid", f"request {rid} is not running")
    (req,) = found
    calls = _Calls(allocator)
    copy = calls.get_cpu_copy(rid, list(req.slots))
    calls.run("free", rid, {"free_index": list(req.slots)})
    fields = req.model_dump(exclude={"slots", "swa_evicted_seqlen"})
    back = RetractedRequest(**fields, kv=copy, length=len(req.slots))
    new = node.model_copy(update={"running": tuple(r for r in node.running if r.rid != rid),
                                  "retracted": (*node.retracted, back)})
    return StepResult(node=new, allocator=calls.state, calls=tuple(calls.calls), rids=(rid,))


def resume_retracted_reqs(node: DecodeNode, allocator: sa.SWAAllocatorState) -> StepResult:
    """Re-admit retracted requests in order (budgets without the retracted queue), then load their KV (§2.5).

    The budgets keep no "can finish" room (``reserve_finish=False``): SGLang's resume round passes its budget
    functions no retractable counts (model gap M1, closed: sglang_semantics.md §2.5 says "the same budgets").

    UPSTREAM decrements both budgets by the unrounded requirements between
    admissions (R4); CORRECTED recomputes them.
    """
    calls, start = _Calls(allocator), node
    budgets = allocatable_token_budgets(node, allocator, count_retracted=False, reserve_finish=False)
    running, resumed = list(node.running), list[int]()
    for req in node.retracted:
        gate = resume_gate(start, allocator, budgets, req)
        if not gate.admit:
            break
        full_req, swa_req = gate.full_required, gate.swa_required
        try:
            slots = _pre_alloc(node, calls, req)
        except OutOfMemory as err:
            crash = Crash(rid=req.rid, op="resume_retracted_reqs", budgets=(budgets.full, budgets.swa),
                          required=(full_req, swa_req), message=str(err))
            return _resumed(node, calls, running, resumed, crash)
        calls.run("load_cpu_copy", req.rid, {"kv_cpu": req.kv, "indices": list(slots)})
        running.append(_start(node, calls, req, slots))
        resumed.append(req.rid)
        budgets = _refresh(start, calls.state, budgets, gate, len(resumed) - 1, count_retracted=False,
                           decrement_full=True)
    return _resumed(node, calls, running, resumed, None)


def _resumed(node: DecodeNode, calls: _Calls, running: list[RunningRequest], resumed: list[int],
             crash: Crash | None) -> StepResult:
    retracted = tuple(r for r in node.retracted if r.rid not in resumed)
    new = node.model_copy(update={"running": tuple(running), "retracted": retracted})
    return StepResult(node=new, allocator=calls.state, calls=tuple(calls.calls), rids=tuple(resumed), crash=crash)


# ---------------------------------------------------------------- invariants of a node


def check_node(node: DecodeNode, allocator: sa.SWAAllocatorState) -> None:
    """No leak (every allocated page belongs to a running request, and back), and D3 residency (tail mode).

    D3 (§7): a running request's SWA-resident positions lie in
    ``[floor_P(max(0, L - 1 - W - P)), L)``, so at most ``W + 2P`` of them.
    """
    p, w = allocator.config.page_size, allocator.config.sliding_window_size
    mapping = allocator.full_to_swa_index_mapping
    owners = {r.rid for r in node.running}
    for name, pool in (("full", allocator.full), ("swa", allocator.swa)):
        strays = sorted({who for who in pool.owner[1:] if who is not None and who != LEAKED} - owners)
        # an allocated page belongs to a running request (retracted and finished ones hold nothing; a leaked one,
        # which only a run following an implementation's documented leak makes, to nobody)
        ensure(not strays, "G3", f"{name} pages held by requests that are not running: {strays}")
    for req in node.running:
        pages = {f // p for f in req.slots}
        # every KV position of a running request sits in one of its own full pages
        ensure(all(allocator.full.owner[g] == req.rid for g in pages), "G3", f"request {req.rid} lost a page")
        if not uses_tail(node, allocator):
            continue
        low = floor_p(max(0, len(req.slots) - 1 - w - p), p)
        resident = [j for j, f in enumerate(req.slots) if mapping[f] > 0]
        # D3: SWA residency stays within the window tail
        ensure(all(j >= low for j in resident), "D3",
               f"request {req.rid} (L={len(req.slots)}) keeps SWA slots for positions {resident[:4]}... below {low}")

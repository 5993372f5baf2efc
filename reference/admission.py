"""``admission``: the prefill adder's SWA budget against HiCache load-back, as pure operations.

Models PR #27391 and its successors at the scheduler level (sglang_semantics.md §5, §7 A1-A3,
§8 item 8, §9 S8 S9; upstream_0523_vllm_fuzz.md §1 for 0.5.23). The state is

* the **SWA device pool** in pages: ``available`` (free), *evictable* (device SWA of unlocked tree
  nodes), *locked* (device SWA of locked tree nodes, plus the pages requests hold for their
  chunks); ``available + evictable + locked == swa_pages`` after every operation (§1.4);
* a **radix tree** of :class:`Node` values (a parent index, a page-aligned token length, Full KV on
  device or on host, the SWA value on device, on host only (a *host tombstone*) or neither, a
  ``lock_ref``); the tree is a forest under an implicit root (parent ``-1``);
* the **requests** (prompt length, the clipped ``max_new_tokens`` estimate, their best-match node,
  the match-time :class:`MatchResult` snapshot, the nodes their lock holds, their chunk);
* the round's :class:`PrefillAdder` (``rem_swa_token_offset``, ``rem_chunk_tokens``, ``can_run``).

Operations, named like SGLang's (they are the Z3 transitions of ``kvproof.spec.admission``):
:func:`arrive`, :func:`get_new_batch_prefill` (a round starts: the adder is built),
:func:`match_prefix_for_req` (the match-time snapshot, §5.4), :func:`add_one_req` (§5.3: the check
outside the tree lock, :func:`inc_lock_ref`, the check inside it, :func:`init_load_back`, the chunk,
:func:`update_prefill_budget`), :func:`add_chunked_req` (a chunked request's next chunk, first in its
round), :func:`prepare_for_extend` (the round's SWA allocation of every admitted chunk, evicting first;
"Prefill out of memory" is :class:`OutOfMemory`), :func:`evict`, :func:`cache_unfinished_req` (a chunk ran
and the prompt has more: the prefix grows, out-of-window pages are freed), :func:`cache_finished_req`
(completion: the request's pages back, the lock released). Budgets:
:func:`swa_budget_for_req` (0.5.13's ``_swa_budget_for_req``), :func:`estimate_swa_kv_tokens` and
:func:`check_prefill` (0.5.23's ``SWAPrefillBudget``).

The window walk (:func:`window_walk`, §5.4): from the best-match node towards the root while fewer
than ``W`` tokens are covered, a device SWA node covers its length, a host tombstone is loaded back
and covers its length, a node with neither stops the walk. The walk locks what it visits
(:func:`inc_lock_ref`, the window lock of §1.7) and ``init_load_back`` restores what it finds.

The policy is one typed parameter, :class:`AdmissionPolicy`:

* ``PRE_27391`` (0.5.12.post1): budget ``max(min(e, C), W) + P`` (``e``: extend length before
  load-back, ``C``: ``rem_chunk_tokens``); a host tombstone in the window only sets
  ``host_hit_length = max(host_hit_length, 1)`` (§5.5). Load-back still allocates and locks whole
  host tombstones: S8 ("Prefill out of memory" right after admission);
* ``UPSTREAM_27391`` (the fix as merged, 0.5.13): ``+ ceil_P(swa_host_hit_length)`` at both checks,
  with the match-time value. Safe when that value is what load-back restores (A1); starves a
  request whose window holds a host tombstone longer than the pool (S9) and undercounts when the
  tree changed since the match (§5.7);
* ``UPSTREAM_0523`` (0.5.23, ``SWAPrefillBudget``): one check, under a pin of the match's last
  *device* node (:func:`last_device_node`), with
  ``needed = estimate_swa_kv_tokens(ceil_P(e'), m, W, P, L=rem_chunk, h) < remaining_swa``
  (``e'`` excludes the Full host hit); a request that can *never* fit (``needed >= size_swa``) gets a
  chunk of ``min(L, floor_P(remaining - estimate(0, m, h)))`` when that is positive (#31681 as
  restricted by #32700); the chunk is decided before load-back (``OTHER`` changes nothing), load-back
  runs only when the match found a host hit (``needs_host_load_back``), the commit locks the
  best-match window and drops the pin; the reservation omits ``h``; ``budget_state`` does not stop at
  a chunked request. Checked step by step against SGLang 0.5.23's real ``PrefillAdder``
  (``kvproof.conformance.adapters.sglang_admission``; docs/sglang-findings.md F4, F5);
* ``CORRECTED`` (kvproof's): the budget of ``UPSTREAM_27391`` with three changes, each needed:
  (1) the host term is what load-back *can restore within the window*: a host tombstone at covered
  length ``c`` contributes ``min(len, ceil_P(W - c))`` tokens, and :func:`init_load_back` restores
  exactly that (the node is split; its root-side rest stays a host tombstone, as #31771 proposes), so
  the term is at most ``ceil_P(W)`` and a request that fits an empty idle pool is admitted in its
  first round (no S9); (2) the term is recomputed from the tree at each check, never taken from the
  match-time snapshot, so a tree changed since the match cannot make it stale; (3) the extend length is
  ``e'``, without the Full host hit (as in 0.5.23: loaded tokens are not computed), else a long Full host
  hit alone can refuse a request forever. Everything is page-rounded (node lengths are whole pages).
  Proved safe (A1) and live in ``kvproof.spec.admission``; the twins ``a1_corrected.uncapped_load_back``,
  ``a1_corrected.snapshot_reused`` and ``live_idle_pool.pre_27391`` show what each change prevents.

**Chunked prefill** (§5.3, last paragraph; upstream_0523_vllm_fuzz.md §1.2 ``available_chunk_tokens``), the
same rules under every policy (§5.3 gives the seed era the same cap as 0.5.23). A request that
``add_one_req`` admits as a chunk (``new_chunked_req``) runs it (:func:`prepare_for_extend`) and still has
prompt left. Its own tokens ``done`` (computed beyond the matched prefix, which is whole pages) are counted
from that prefix:

* :func:`cache_unfinished_req` (its round closed, the forward ran): ``prefix_len += extend_len`` and the
  request frees the SWA pages of its own tokens wholly below ``done - W``: after it, exactly
  :func:`out_of_window_pages` ``= max(0, floor((done - W) / P))`` of them are freed (the rule of
  ``swa_tail_len``, §2.3: the kept tail starts on a page boundary and covers the last ``W`` tokens), the rest
  kept; the status is ``CHUNKED``. The window lock on the tree is **kept until completion**;
* :func:`add_chunked_req`, first thing in the next round (right after :func:`get_new_batch_prefill`, before any
  ``add_one_req``, as the scheduler does): ``avail = min(rem_chunk_tokens, rem_swa_tokens - P)`` (without
  chunked prefill, ``rem_swa_tokens - P``); ``avail <= 0``: ``DEFERRED``, nothing changes (the request stays
  ``CHUNKED``, not in ``can_run``); else the chunk is ``min(rest of the prompt, avail)`` tokens (not
  page-floored, as in 0.5.23: a chunk can end inside a page), reserved like :func:`update_prefill_budget`
  (``ceil_P(chunk)``, ``max_new_tokens`` only for the last chunk; ``rem_chunk_tokens`` before the decrement is
  the limit), appended to ``can_run``; ``TRUNCATED`` if prompt is left after it, else ``LAST``;
* :func:`prepare_for_extend` allocates a continuing chunk's pages past its last, partly filled page:
  :func:`chunk_pages` ``= ceil((done + chunk) / P) - ceil(done / P)`` (§1.3's ``get_num_new_pages``);
* :func:`cache_finished_req` only for a request whose prompt is done (a ``RUNNING`` request with prompt left
  cannot finish: :class:`InvalidOperation`); it frees every page the request still holds.

Proved in ``kvproof.spec.admission``: the round invariant is kept by both operations, an added continuation's
chunk fits and leaves one page (``add_chunked_req.a1``; the ``- P`` is what leaves it, the fit does not need it:
``add_chunked_req.a1_minimal``), the release frees no page of the window
(``cache_unfinished_req.frees_out_of_window_only``), the allocation wastes no page
(``prepare_for_extend.continuation_pages_exact``).

Liveness reads :func:`fits_empty_pool`: the request's own pinned window pages plus
``max(min(e', C), W) + P + ceil_P(W)`` stay below the pool: what any budget charging load-back at
most one page-rounded window would admit from an empty idle pool.

[Differs from SGLang:]

* the Full pool is not modelled (it is assumed large enough; #27391 is about the SWA pool); Full
  load-back always succeeds and only moves the prefix;
* ``init_load_back`` restores the walk it finds at lock time, under the seed-era policies whatever
  the match found (upstream triggers it from the match-time lengths, ``needs_host_load_back``, as
  ``UPSTREAM_0523`` here does); a failed load-back raises :class:`OutOfMemory` and
  changes nothing (upstream rolls back and prefills the host part again): admission promised those
  pages (A1);
* eviction tombstones unlocked device SWA nodes in ascending node index (the reference's stand-in
  for LRU) and keeps a host copy (HiCache write-through), whole nodes at a time;
* a finished request's chunk pages go back to the free list (upstream inserts them into the tree,
  where they become evictable; the sum ``available + evictable`` is the same);
* a chunk's computed tokens are not inserted into the tree: ``cache_unfinished_req`` keeps them as the
  request's own pages and keeps its window lock on the matched prefix until completion (0.5.23 inserts them,
  moves the lock to the new last node and frees out-of-window SWA from ``len(key) - 1 - ceil_P(max(W, P))``,
  page-floored: up to a page more than the rule above); the Full budget (``remaining_total``), the
  Mamba, LoRA and sharding limits of ``add_chunked_req`` are not modelled.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvproof.reference.arith import ceil_div, ceil_p, floor_p, num_new_pages
from kvproof.reference.config import ConfigModel
from kvproof.reference.errors import ConfigError, InvalidOperation, OutOfMemory, ensure, require

__all__ = [
    "AddReqResult",
    "AdmissionConfig",
    "AdmissionPolicy",
    "AdmissionSetup",
    "AdmissionSnapshot",
    "AdmissionState",
    "ChunkedResult",
    "MatchResult",
    "Node",
    "PrefillAdder",
    "ReqStatus",
    "Request",
    "SwaValue",
    "WindowWalk",
    "add_chunked_req",
    "add_one_req",
    "arrive",
    "budget_state",
    "cache_finished_req",
    "cache_unfinished_req",
    "check_admission",
    "check_admission_snapshot",
    "check_prefill",
    "chunk_pages",
    "dec_lock_ref",
    "estimate_swa_kv_tokens",
    "evict",
    "fits_empty_pool",
    "get_new_batch_prefill",
    "inc_lock_ref",
    "init_load_back",
    "initial_state",
    "last_device_node",
    "match_prefix_for_req",
    "needs_host_load_back",
    "out_of_window_pages",
    "own_len",
    "path_len",
    "prepare_for_extend",
    "rem_swa_tokens",
    "swa_budget_for_req",
    "swa_evictable_pages",
    "swa_held_pages",
    "swa_locked_pages",
    "swa_protected_pages",
    "update_prefill_budget",
    "window_walk",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class AdmissionPolicy(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """Which SWA admission budget the prefill adder uses (module docstring)."""

    PRE_27391 = "pre_27391"  # max(min(e, C), W) + P: load-back not counted (S8)
    UPSTREAM_27391 = "upstream_27391"  # + ceil_P(match-time swa_host_hit_length): whole tombstones (S9), stale
    UPSTREAM_0523 = "upstream_0523"  # estimate_swa_kv_tokens / SWAPrefillBudget with the never-fits chunk cap
    CORRECTED = "corrected"  # + the window-capped restore, recomputed at each check


class AddReqResult(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """``add_one_req``'s verdict (§5.3 step 9)."""

    CONTINUE = "continue"
    NO_TOKEN = "no_token"
    OTHER = "other"


class ChunkedResult(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """``add_chunked_req``'s outcome (§5.3; upstream returns the request while it stays chunked, else None)."""

    DEFERRED = "deferred"  # available_chunk_tokens <= 0: not scheduled this round, nothing changed
    TRUNCATED = "truncated"  # a chunk added, prompt left after it: still chunked
    LAST = "last"  # the rest of the prompt added


class SwaValue(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """Where a node's SWA value lives (§1.7)."""

    DEVICE = "device"
    HOST = "host"  # host tombstone: no device SWA, a host copy load-back can restore
    NONE = "none"  # tombstone without host copy: a window walk stops here


class ReqStatus(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    WAITING = "waiting"
    ADMITTED = "admitted"  # in the round's can_run list, chunk not allocated yet
    RUNNING = "running"  # chunk allocated by prepare_for_extend
    FINISHED = "finished"
    CHUNKED = "chunked"  # its chunk ran and is cached (cache_unfinished_req); add_chunked_req continues it


class AdmissionConfig(ConfigModel):
    """The SWA pool, the geometry and the policy."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    page_size: int = Field(ge=1, description="P: tokens per page")
    sliding_window: int = Field(ge=1, description="W: sliding window in tokens")
    swa_pages: int = Field(ge=1, description="pages of the SWA device pool (size_swa = swa_pages * P)")
    chunk_size: int | None = Field(default=None, ge=1, description="rem_chunk_tokens at a round's start (None: "
                                                                     "chunked prefill off)")
    policy: AdmissionPolicy = AdmissionPolicy.CORRECTED

    @model_validator(mode="after")
    def _chunk_pages(self) -> AdmissionConfig:
        # a chunk is truncated to whole pages: a chunk below one page could never make progress
        if self.chunk_size is not None and self.chunk_size < self.page_size:
            raise ConfigError("AdmissionConfig", "chunk_size",
                              f"must be at least page_size ({self.page_size}), got {self.chunk_size}")
        return self

    @property
    def size_swa(self) -> int:
        return self.swa_pages * self.page_size


class Node(BaseModel):
    """A radix node: parent index (-1: child of the root), length in tokens (whole pages), where its KV lives."""

    model_config = _FROZEN

    parent: int
    length: int
    full_on_device: bool
    swa: SwaValue
    lock_ref: int = 0


class MatchResult(BaseModel):
    """The match-time snapshot (§5.1): Full device prefix, Full host hit, SWA host hit, in tokens."""

    model_config = _FROZEN

    device_prefix_len: int
    host_hit_length: int
    swa_host_hit_length: int


class Request(BaseModel):
    """A request: prompt, clipped decode estimate, best-match node, snapshot, lock, chunk."""

    model_config = _FROZEN

    prompt_len: int
    max_new_tokens: int
    node: int  # best-match node (-1: nothing matched)
    status: ReqStatus = ReqStatus.WAITING
    match: MatchResult | None = None
    locked: tuple[int, ...] = ()  # the nodes its lock holds (dec_lock_ref releases exactly these)
    prefix_len: int = 0  # matched (after load-back) plus the chunks already run and cached
    extend_len: int = 0  # the scheduled chunk (0 while CHUNKED)
    swa_pages: int = 0  # SWA pages of its own tokens it holds (allocated by prepare_for_extend, less those freed)


class PrefillAdder(BaseModel):
    """One scheduling round's budget state (§5.1)."""

    model_config = _FROZEN

    rem_swa_token_offset: int = 0
    rem_chunk_tokens: int | None = None
    can_run: tuple[int, ...] = ()
    new_chunked_req: int | None = None


class AdmissionState(BaseModel):
    """The SWA pool's free pages, the tree, the requests (rid = index), the open round's adder."""

    model_config = _FROZEN

    config: AdmissionConfig
    available: int
    nodes: tuple[Node, ...] = ()
    requests: tuple[Request, ...] = ()
    adder: PrefillAdder | None = None


class AdmissionSetup(ConfigModel):
    """What a conformance run starts from: the pool and policy, and the tree the server has cached so far.

    The tree is fixed at the start (the model inserts no node; load-back splits and eviction change it).
    ``kvproof.conformance.admission`` builds both sides from one setup.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    config: AdmissionConfig
    nodes: tuple[Node, ...] = ()

    @model_validator(mode="after")
    def _valid_tree(self) -> AdmissionSetup:
        initial_state(self.config, self.nodes)  # ConfigError for a bad tree or one larger than the pool
        return self

    def label(self) -> str:
        """Short id for test ids and reports, e.g. ``long_tombstone-P2-W4-T8-C8`` (the policy is a run option)."""
        c = self.config
        return f"{self.name}-P{c.page_size}-W{c.sliding_window}-T{c.swa_pages}-C{c.chunk_size or 'off'}"

    def with_policy(self, policy: AdmissionPolicy | str) -> AdmissionSetup:
        return self.model_copy(update={"config": self.config.model_copy(update={"policy": AdmissionPolicy(policy)})})


class AdmissionSnapshot(BaseModel):
    """What an admission system under test reports: its decision state in the reference's terms, and the SWA pages
    behind it (each node's device pages, each request's chunk pages, the free list)."""

    model_config = _FROZEN

    state: AdmissionState
    node_pages: tuple[tuple[int, ...], ...]
    request_pages: tuple[tuple[int, ...], ...]
    free_pages: tuple[int, ...]


class WindowWalk(BaseModel):
    """What the window walk from a node finds (§5.4), in pages and tokens."""

    model_config = _FROZEN

    nodes: tuple[int, ...]  # visited, leaf first
    covered: int  # tokens covered by device and host SWA
    stopped: bool  # stopped at a node with neither device nor host SWA before covering W
    device_pages: int  # device SWA pages of the visited nodes
    unlocked_device_pages: int  # ... of those with lock_ref 0 (evictable now, protected once locked)
    host_tokens: int  # sum of whole host tombstones: swa_host_hit_length, upstream's load-back
    capped_tokens: int  # sum of min(len, ceil_P(W - covered)): CORRECTED's load-back
    restores: tuple[tuple[int, int], ...]  # (node, tokens CORRECTED restores), leaf first


# ---------------------------------------------------------------- budgets (mirrored in kvproof.spec.admission)


def swa_budget_for_req(extend_input_len: int, swa_host_hit_length: int, *, window: int, page_size: int,
                       rem_chunk_tokens: int | None) -> int:
    """``_swa_budget_for_req`` (§5.2): ``max(a, W) + P (+ ceil_P(h) if h > 0)``, ``a = min(e, rem_chunk)``.

    ``PRE_27391`` calls it with ``h = 0``; ``update_prefill_budget`` always does.
    """
    alloc = extend_input_len if rem_chunk_tokens is None else min(extend_input_len, rem_chunk_tokens)
    budget = max(alloc, window) + page_size
    if swa_host_hit_length > 0:
        budget += ceil_p(swa_host_hit_length, page_size)
    return budget


def estimate_swa_kv_tokens(extend_len: int, max_new_tokens: int, *, window: int, page_size: int,
                           allocation_limit: int | None = None, host_hit_length: int = 0) -> int:
    """0.5.23's ``estimate_swa_kv_tokens`` (upstream_0523 §1.2): allocated tail + capped decode headroom + a page
    (+ ``ceil_P(h)``)."""
    a = extend_len if allocation_limit is None else min(extend_len, allocation_limit)
    needed = max(a - window, 0) + min(extend_len + max_new_tokens, window) + page_size
    if host_hit_length > 0:
        needed += ceil_p(host_hit_length, page_size)
    return needed


def check_prefill(config: AdmissionConfig, extend_len: int, max_new_tokens: int, swa_host_hit_length: int,
                  remaining_swa: int, chunk_limit: int | None) -> tuple[bool, int | None]:
    """``SWAPrefillBudget.check_prefill``'s SWA part (0.5.23): ``(admit, chunk limit)``.

    ``needed < remaining`` admits with ``chunk_limit``; otherwise only a request that can never fit
    (``needed >= size_swa``) gets ``min(chunk_limit, floor_P(remaining - estimate(0, m, h)))`` when positive.
    """
    w, p = config.sliding_window, config.page_size
    needed = estimate_swa_kv_tokens(ceil_p(extend_len, p), max_new_tokens, window=w, page_size=p,
                                    allocation_limit=chunk_limit, host_hit_length=swa_host_hit_length)
    if needed < remaining_swa:
        return True, chunk_limit
    if needed >= config.size_swa:
        cap = floor_p(remaining_swa - estimate_swa_kv_tokens(0, max_new_tokens, window=w, page_size=p,
                                                             host_hit_length=swa_host_hit_length), p)
        if chunk_limit is not None and cap > 0:
            return True, min(chunk_limit, cap)
    return False, None


def update_prefill_budget(adder: PrefillAdder, config: AdmissionConfig, input_tokens: int,
                          max_new_tokens: int) -> PrefillAdder:
    """``update_prefill_budget`` (§5.3) / ``SWAPrefillBudget.reserve``: the SWA reservation **without** the host term
    (load-back already took its pages out of ``available``), then ``rem_chunk_tokens -= ceil_P(e)``."""
    p, w, chunk = config.page_size, config.sliding_window, adder.rem_chunk_tokens
    e = ceil_p(input_tokens, p)
    if config.policy is AdmissionPolicy.UPSTREAM_0523:
        reserve = estimate_swa_kv_tokens(e, max_new_tokens, window=w, page_size=p, allocation_limit=chunk)
    else:
        reserve = swa_budget_for_req(e, 0, window=w, page_size=p, rem_chunk_tokens=chunk)
    return adder.model_copy(update={"rem_swa_token_offset": adder.rem_swa_token_offset + reserve,
                                    "rem_chunk_tokens": None if chunk is None else chunk - e})


def needs_host_load_back(match: MatchResult) -> bool:
    """``Req.needs_host_load_back`` (A3; Mamba's length is 0 here)."""
    return match.host_hit_length > 0 or match.swa_host_hit_length > 0


# ---------------------------------------------------------------- construction and queries


def initial_state(config: AdmissionConfig, nodes: Sequence[Node] = ()) -> AdmissionState:
    """A pool holding the device SWA of ``nodes`` (unlocked), the rest free; no request, no round."""
    for i, node in enumerate(nodes):
        _check_node(config, nodes, i, node)
    used = sum(n.length // config.page_size for n in nodes if n.swa is SwaValue.DEVICE)
    if used > config.swa_pages:
        raise ConfigError("AdmissionState", "nodes", f"device SWA of the tree ({used} pages) exceeds the pool "
                                                      f"({config.swa_pages} pages)")
    return AdmissionState(config=config, available=config.swa_pages - used, nodes=tuple(nodes))


def path_len(state: AdmissionState, node: int) -> int:
    """Tokens on the path from the root to ``node`` (the matched length)."""
    total = 0
    while node != -1:
        total += state.nodes[node].length
        node = state.nodes[node].parent
    return total


def window_walk(state: AdmissionState, node: int) -> WindowWalk:
    """The window walk from ``node`` (§5.4): what it covers, locks, counts and restores."""
    w, p = state.config.sliding_window, state.config.page_size
    visited: list[int] = []
    restores: list[tuple[int, int]] = []
    covered = dev = unlocked = host = 0
    stopped = False
    while node != -1 and covered < w:
        n = state.nodes[node]
        if n.swa is SwaValue.NONE:
            stopped = True
            break
        visited.append(node)
        if n.swa is SwaValue.DEVICE:
            dev += n.length // p
            unlocked += n.length // p if n.lock_ref == 0 else 0
        else:
            host += n.length
            restores.append((node, min(n.length, ceil_p(w - covered, p))))
        covered += n.length
        node = n.parent
    return WindowWalk(nodes=tuple(visited), covered=covered, stopped=stopped, device_pages=dev,
                      unlocked_device_pages=unlocked, host_tokens=host, capped_tokens=sum(r for _, r in restores),
                      restores=tuple(restores))


def swa_evictable_pages(state: AdmissionState) -> int:
    """Device SWA pages of unlocked nodes (``swa_evictable_size / P``)."""
    p = state.config.page_size
    return sum(n.length // p for n in state.nodes if n.swa is SwaValue.DEVICE and n.lock_ref == 0)


def swa_protected_pages(state: AdmissionState) -> int:
    """Device SWA pages of locked nodes (``swa_protected_size / P``)."""
    p = state.config.page_size
    return sum(n.length // p for n in state.nodes if n.swa is SwaValue.DEVICE and n.lock_ref > 0)


def swa_held_pages(state: AdmissionState) -> int:
    """SWA pages requests hold for their chunks (§1.4's "uncached")."""
    return sum(r.swa_pages for r in state.requests)


def swa_locked_pages(state: AdmissionState) -> int:
    """Pages nothing can evict: protected tree pages and the pages requests hold."""
    return swa_protected_pages(state) + swa_held_pages(state)


def rem_swa_tokens(state: AdmissionState) -> int:
    """``rem_swa_tokens = swa_available + swa_evictable - rem_swa_token_offset`` (§5.1), in tokens."""
    offset = state.adder.rem_swa_token_offset if state.adder is not None else 0
    return (state.available + swa_evictable_pages(state)) * state.config.page_size - offset


def own_len(state: AdmissionState, rid: int) -> int:
    """Tokens request ``rid`` computed itself: its prefix beyond the matched path (whole pages), 0 before its first
    chunk ran."""
    req = _request(state, "own_len", rid)
    if req.status is ReqStatus.WAITING:
        return 0
    return req.prefix_len - path_len(state, req.node)


def out_of_window_pages(done: int, *, window: int, page_size: int) -> int:
    """Pages of a request's ``done`` own tokens wholly below ``done - W``: ``max(0, floor((done - W) / P))`` (what
    :func:`cache_unfinished_req` has freed; the kept tail is ``swa_tail_len``, §2.3)."""
    return max(0, done - window) // page_size


def chunk_pages(state: AdmissionState, rid: int) -> int:
    """Pages :func:`prepare_for_extend` allocates for request ``rid``'s chunk: ``ceil((done + e) / P) - ceil(done /
    P)`` for ``done`` own tokens (§1.3, ``get_num_new_pages``): the chunk first fills its last, partly filled page."""
    req = _request(state, "chunk_pages", rid)
    done = own_len(state, rid)
    return num_new_pages(done, done + req.extend_len, state.config.page_size)


def fits_empty_pool(state: AdmissionState, rid: int) -> bool:
    """The liveness premise: ``max(min(e', C), W) + P + ceil_P(W) < (swa_pages - own) * P`` (module docstring)."""
    c, req = state.config, _request(state, "fits_empty_pool", rid)
    e = req.prompt_len - path_len(state, req.node)
    a = e if c.chunk_size is None else min(e, c.chunk_size)
    own = window_walk(state, req.node).device_pages
    need = max(a, c.sliding_window) + c.page_size + ceil_p(c.sliding_window, c.page_size)
    return need < (c.swa_pages - own) * c.page_size


# ---------------------------------------------------------------- tree operations


def inc_lock_ref(state: AdmissionState, node: int) -> tuple[AdmissionState, tuple[int, ...]]:
    """Lock the window walk from ``node`` (§1.7: device SWA moves from evictable to protected); returns the nodes
    (none for ``-1``, the root)."""
    if node != -1:
        _check_node_id(state, "inc_lock_ref", node)
    held = window_walk(state, node).nodes
    nodes = list(state.nodes)
    for i in held:
        nodes[i] = nodes[i].model_copy(update={"lock_ref": nodes[i].lock_ref + 1})
    return state.model_copy(update={"nodes": tuple(nodes)}), held


def dec_lock_ref(state: AdmissionState, held: Sequence[int]) -> AdmissionState:
    """Release exactly the nodes a lock holds."""
    for i in held:
        _check_node_id(state, "dec_lock_ref", i)
        # a lock is released once: every node it holds still counts it
        require(state.nodes[i].lock_ref > 0, "dec_lock_ref", "held", f"node {i} is not locked")
    nodes = list(state.nodes)
    for i in held:
        nodes[i] = nodes[i].model_copy(update={"lock_ref": nodes[i].lock_ref - 1})
    return state.model_copy(update={"nodes": tuple(nodes)})


def evict(state: AdmissionState, num_pages: int) -> AdmissionState:
    """Tombstone unlocked device SWA nodes (ascending index, whole nodes, host copy kept) until ``num_pages`` pages
    are freed or nothing is evictable (best effort, as the tree's ``evict``)."""
    require(num_pages >= 0, "evict", "num_pages", f"must be >= 0, got {num_pages}")
    p, freed = state.config.page_size, 0
    nodes = list(state.nodes)
    for i, n in enumerate(nodes):
        if freed >= num_pages:
            break
        if n.swa is SwaValue.DEVICE and n.lock_ref == 0:
            nodes[i] = n.model_copy(update={"swa": SwaValue.HOST})
            freed += n.length // p
    return state.model_copy(update={"nodes": tuple(nodes), "available": state.available + freed})


def _alloc(state: AdmissionState, op: str, pages: int, rid: int | None) -> AdmissionState:
    """Take ``pages`` SWA pages, evicting first when short; :class:`OutOfMemory` (nothing changed) if still short."""
    if pages <= state.available:
        return state.model_copy(update={"available": state.available - pages})
    room = state.available + swa_evictable_pages(state)
    if pages > room:
        raise OutOfMemory(op, "swa", pages, room, request=rid)
    state = evict(state, pages - state.available)
    return state.model_copy(update={"available": state.available - pages})


# ---------------------------------------------------------------- the scheduler's operations


def arrive(state: AdmissionState, prompt_len: int, max_new_tokens: int, node: int
           ) -> tuple[AdmissionState, int]:
    """A request joins the waiting queue; ``node`` is its best-match node (``-1``: none). Returns its rid."""
    op = "arrive"
    require(max_new_tokens >= 0, op, "max_new_tokens", f"must be >= 0, got {max_new_tokens}")
    if node != -1:
        _check_node_id(state, op, node)
    matched = path_len(state, node)
    # the match leaves at least one token to compute (SGLang matches at most len - 1)
    require(matched < prompt_len, op, "prompt_len", f"{prompt_len} tokens, {matched} matched: nothing to extend")
    # the SWA match validator: every node within W of the boundary has device or host SWA (§5.4)
    require(not window_walk(state, node).stopped, op, "node",
            f"the window of node {node} reaches a node with neither device nor host SWA (not a valid boundary)")
    req = Request(prompt_len=prompt_len, max_new_tokens=max_new_tokens, node=node)
    return state.model_copy(update={"requests": (*state.requests, req)}), len(state.requests)


def get_new_batch_prefill(state: AdmissionState) -> AdmissionState:
    """A scheduling round starts: the ``PrefillAdder`` is built (offset 0, ``rem_chunk_tokens = chunk_size``)."""
    require(state.adder is None, "get_new_batch_prefill", "state", "a round is already open")
    return state.model_copy(update={"adder": PrefillAdder(rem_chunk_tokens=state.config.chunk_size)})


def match_prefix_for_req(state: AdmissionState, rid: int) -> AdmissionState:
    """The match-time snapshot (§5.4): Full device prefix, Full host hit, the window walk's whole host tombstones.

    ``PRE_27391``: no SWA field; a host tombstone in the window sets ``host_hit_length = max(., 1)`` (§5.5).
    """
    op = "match_prefix_for_req"
    req = _request(state, op, rid)
    require(req.status is ReqStatus.WAITING, op, "rid", f"request {rid} is {req.status.value}, not waiting")
    path, node = [], req.node
    while node != -1:
        path.append(state.nodes[node])
        node = state.nodes[node].parent
    device = sum(n.length for n in path if n.full_on_device)
    host = sum(n.length for n in path if not n.full_on_device)
    swa_host = window_walk(state, req.node).host_tokens
    if state.config.policy is AdmissionPolicy.PRE_27391:
        match = MatchResult(device_prefix_len=device, host_hit_length=max(host, 1) if swa_host else host,
                            swa_host_hit_length=0)
    else:
        match = MatchResult(device_prefix_len=device, host_hit_length=host, swa_host_hit_length=swa_host)
    return _set_request(state, rid, req.model_copy(update={"match": match}))


def init_load_back(state: AdmissionState, rid: int) -> tuple[AdmissionState, int]:
    """Restore the host tombstones of request ``rid``'s window walk into the SWA device pool (§5.4).

    The caller holds the window lock (the restored pages become protected). Upstream policies restore whole
    nodes; ``CORRECTED`` restores ``min(len, ceil_P(W - covered))`` tokens of each, splitting the node (its
    root-side rest stays a host tombstone). Pages are allocated evicting first; short: :class:`OutOfMemory`,
    nothing changed (the rollback). Returns the state and the pages restored.
    """
    op = "init_load_back"
    req = _request(state, op, rid)
    # load-back runs under the request's window lock, taken by add_one_req
    require(bool(req.locked) or req.node == -1, op, "rid", f"request {rid} does not hold its window lock")
    return _load_back(state, rid, req)


def _load_back(state: AdmissionState, rid: int, req: Request) -> tuple[AdmissionState, int]:
    op = "init_load_back"
    walk, p = window_walk(state, req.node), state.config.page_size
    capped = state.config.policy is AdmissionPolicy.CORRECTED
    restores = walk.restores if capped else tuple((i, state.nodes[i].length) for i, _ in walk.restores)
    pages = sum(t for _, t in restores) // p
    state = _alloc(state, op, pages, rid)
    nodes = list(state.nodes)
    node = req.node
    while node != -1:  # the Full host hit is loaded back too (the Full pool is not modelled)
        nodes[node] = nodes[node].model_copy(update={"full_on_device": True})
        node = nodes[node].parent
    for i, tokens in restores:
        n = nodes[i]
        if tokens < n.length:  # split: the root-side rest keeps the host copy, outside the window
            rest = n.model_copy(update={"length": n.length - tokens, "lock_ref": 0})
            nodes.append(rest)
            nodes[i] = n.model_copy(update={"length": tokens, "parent": len(nodes) - 1, "swa": SwaValue.DEVICE})
        else:
            nodes[i] = n.model_copy(update={"swa": SwaValue.DEVICE})
    return state.model_copy(update={"nodes": tuple(nodes)}), pages


def add_one_req(state: AdmissionState, rid: int) -> tuple[AdmissionState, AddReqResult]:
    """``PrefillAdder.add_one_req`` (§5.3; 0.5.23: one check inside the lock) for a matched, waiting request.

    NO_TOKEN (nothing changed) when a check fails; a failed load-back raises :class:`OutOfMemory` (A1
    broken, nothing changed). Admitted: the request keeps its lock, its prefix includes the loaded host
    hit, its extend is the whole rest or one page-aligned chunk, the adder reserves its budget.
    """
    op, c = "add_one_req", state.config
    adder = _open_adder(state, op)
    req = _request(state, op, rid)
    require(req.status is ReqStatus.WAITING, op, "rid", f"request {rid} is {req.status.value}, not waiting")
    if req.match is None:
        raise InvalidOperation(op, "rid", f"request {rid} has no match (match_prefix_for_req first)")
    match = req.match
    policy, p, w = c.policy, c.page_size, c.sliding_window
    chunk = adder.rem_chunk_tokens
    if policy is AdmissionPolicy.UPSTREAM_0523:
        return _add_one_req_0523(state, rid, adder, req, match)
    e_after = req.prompt_len - path_len(state, req.node)

    def fits(s: AdmissionState) -> tuple[bool, int | None]:
        rem = rem_swa_tokens(s)
        if policy is AdmissionPolicy.CORRECTED:
            e, h = e_after, window_walk(s, req.node).capped_tokens  # recomputed from the tree now
        else:
            e = req.prompt_len - match.device_prefix_len
            h = match.swa_host_hit_length  # PRE_27391's match leaves it 0
        budget = swa_budget_for_req(e, h, window=w, page_size=p, rem_chunk_tokens=chunk)
        return budget < rem, chunk  # upstream: `budget >= rem_swa_tokens` -> NO_TOKEN

    if not fits(state)[0]:  # the check outside the lock
        return state, AddReqResult.NO_TOKEN
    locked, held = inc_lock_ref(state, req.node)
    ok, limit = fits(locked)  # the check inside the lock: the request's own window is protected now
    if not ok:
        return state, AddReqResult.NO_TOKEN
    locked = _set_request(locked, rid, req.model_copy(update={"locked": held}))
    loaded, _ = init_load_back(locked, rid)
    prefix = path_len(loaded, req.node)
    e = req.prompt_len - prefix
    if limit is None or ceil_p(e, p) <= limit:
        extend, input_tokens, max_new, chunked = e, ceil_p(e, p), req.max_new_tokens, False
    else:
        trunc = floor_p(limit, p)
        if trunc <= 0:  # no room for a page: the lock is released, the loaded nodes stay (evictable)
            return _set_request(dec_lock_ref(loaded, held), rid, req), AddReqResult.OTHER
        extend, input_tokens, max_new, chunked = trunc, trunc, 0, True
    return _commit(loaded, rid, req, held, prefix, extend, input_tokens, max_new, chunked)


def last_device_node(state: AdmissionState, node: int) -> int:
    """The deepest node on the path to ``node`` whose Full KV is on device (``-1``: none): the match's
    ``last_device_node``, which 0.5.23's selection lock pins."""
    while node != -1 and not state.nodes[node].full_on_device:
        node = state.nodes[node].parent
    return node


def _add_one_req_0523(state: AdmissionState, rid: int, adder: PrefillAdder, req: Request, match: MatchResult
                      ) -> tuple[AdmissionState, AddReqResult]:
    """0.5.23's ``add_one_req`` (upstream_0523_vllm_fuzz.md §1.1): under a pin of the match's last *device* node
    (``_lock_node(req.last_node)``), ``_select_prefill_admission`` decides from the match-time lengths -- the check
    (``SWAPrefillBudget.check_prefill``) and the chunk, ``OTHER`` with nothing changed when no page of chunk is left
    -- then, if the match found a host hit (``needs_host_load_back``), ``init_load_back`` restores the walk from the
    best-match node under that pin; the commit locks the best-match node's window and the pin is released."""
    c, p = state.config, state.config.page_size
    chunk = adder.rem_chunk_tokens
    pinned, pin = inc_lock_ref(state, last_device_node(state, req.node))
    prefix = match.device_prefix_len + match.host_hit_length
    e = req.prompt_len - prefix
    ok, limit = check_prefill(c, e, req.max_new_tokens, match.swa_host_hit_length, rem_swa_tokens(pinned), chunk)
    if not ok:
        return state, AddReqResult.NO_TOKEN
    if limit is None or ceil_p(e, p) <= limit:
        extend, input_tokens, max_new, chunked = e, ceil_p(e, p), req.max_new_tokens, False
    else:
        extend = floor_p(limit, p)  # prefix is whole pages: (prefix + extend) stays page-aligned
        if extend <= 0:
            return state, AddReqResult.OTHER
        input_tokens, max_new, chunked = extend, 0, True
    loaded = pinned
    if needs_host_load_back(match):  # under the pin only (0.5.23 locks nothing else for a non-unified tree)
        loaded, _ = _load_back(pinned, rid, req)
    loaded, held = inc_lock_ref(loaded, req.node)  # the commit's lock
    loaded = dec_lock_ref(loaded, pin)
    return _commit(loaded, rid, req, held, prefix, extend, input_tokens, max_new, chunked)


def _commit(state: AdmissionState, rid: int, req: Request, held: tuple[int, ...], prefix: int, extend: int,
            input_tokens: int, max_new: int, chunked: bool) -> tuple[AdmissionState, AddReqResult]:
    """An admission: the reservation (``update_prefill_budget``), the request in ``can_run`` holding its lock."""
    adder = _open_adder(state, "add_one_req")
    new_adder = update_prefill_budget(adder, state.config, input_tokens, max_new)
    new_adder = new_adder.model_copy(update={"can_run": (*adder.can_run, rid),
                                             "new_chunked_req": rid if chunked else adder.new_chunked_req})
    admitted = req.model_copy(update={"status": ReqStatus.ADMITTED, "locked": held, "prefix_len": prefix,
                                      "extend_len": extend})
    out = _set_request(state, rid, admitted).model_copy(update={"adder": new_adder})
    return out, budget_state(out)


def budget_state(state: AdmissionState) -> AddReqResult:
    """``budget_state`` (§5.3 step 9), SWA part: NO_TOKEN when no SWA budget is left (or no round is open), OTHER
    when the chunk is used up or a chunked request was added, else CONTINUE. The scheduler stops adding once it
    is OTHER (after :func:`add_chunked_req` too)."""
    adder = state.adder
    if adder is None or rem_swa_tokens(state) <= 0:
        return AddReqResult.NO_TOKEN
    # 0.5.23's budget_state does not stop at a chunked request (the next add finds no page of chunk left)
    stop_at_chunk = state.config.policy is not AdmissionPolicy.UPSTREAM_0523 and adder.new_chunked_req is not None
    if stop_at_chunk or (adder.rem_chunk_tokens is not None and adder.rem_chunk_tokens <= 0):
        return AddReqResult.OTHER
    return AddReqResult.CONTINUE


def add_chunked_req(state: AdmissionState, rid: int) -> tuple[AdmissionState, ChunkedResult]:
    """``PrefillAdder.add_chunked_req`` (§5.3, last paragraph; 0.5.23: ``SWAPrefillBudget.available_chunk_tokens``):
    the next chunk of a ``CHUNKED`` request, first thing in its round.

    ``avail = min(rem_chunk_tokens, rem_swa_tokens - P)`` (the page is left for the rest of the step, #23174);
    ``avail <= 0``: ``DEFERRED``, nothing changed. Else the chunk is ``min(rest of the prompt, avail)`` tokens (not
    page-floored), reserved as :func:`update_prefill_budget` does (``max_new_tokens`` only when it is the last;
    0.5.23: ``reserve(ceil_P(chunk), ..., chunk_limit=rem_chunk_tokens, is_chunked_continuation=True)``), the
    request appended to ``can_run`` (``ADMITTED``); ``TRUNCATED`` when prompt is left after it, else ``LAST``.
    """
    op, c = "add_chunked_req", state.config
    adder = _open_adder(state, op)
    req = _request(state, op, rid)
    require(req.status is ReqStatus.CHUNKED, op, "rid",
            f"request {rid} is {req.status.value}, not chunked (cache_unfinished_req makes it so)")
    chunk = adder.rem_chunk_tokens
    avail = rem_swa_tokens(state) - c.page_size
    if chunk is not None:
        avail = min(chunk, avail)
    if avail <= 0:
        return state, ChunkedResult.DEFERRED
    rest = req.prompt_len - req.prefix_len
    new_len, truncated = min(rest, avail), rest > avail
    new_adder = update_prefill_budget(adder, c, ceil_p(new_len, c.page_size), 0 if truncated else req.max_new_tokens)
    new_adder = new_adder.model_copy(update={"can_run": (*adder.can_run, rid)})
    added = req.model_copy(update={"status": ReqStatus.ADMITTED, "extend_len": new_len})
    out = _set_request(state, rid, added).model_copy(update={"adder": new_adder})
    return out, ChunkedResult.TRUNCATED if truncated else ChunkedResult.LAST


def prepare_for_extend(state: AdmissionState) -> AdmissionState:
    """The round's batch allocates every admitted chunk's SWA pages at once (evicting first) and the round closes.

    A chunk takes :func:`chunk_pages`: ``ceil(e / P)`` for a first chunk (prefixes are whole pages, node lengths
    are), the pages past the last, partly filled one for a continuation. Short: :class:`OutOfMemory` ("Prefill
    out of memory. Try to allocate N tokens", §5.5), nothing changed.
    """
    op = "prepare_for_extend"
    adder = _open_adder(state, op)
    pages = {rid: chunk_pages(state, rid) for rid in adder.can_run}
    state = _alloc(state, op, sum(pages.values()), adder.can_run[0] if adder.can_run else None)
    for rid, k in pages.items():
        req = state.requests[rid]
        state = _set_request(state, rid, req.model_copy(update={"status": ReqStatus.RUNNING,
                                                                "swa_pages": req.swa_pages + k}))
    return state.model_copy(update={"adder": None})


def cache_unfinished_req(state: AdmissionState, rid: int) -> AdmissionState:
    """A running chunk ran and the prompt has more (§5.3; the round closed, the next not started): the prefix grows by
    the chunk and the request frees the pages of its own tokens that left the window, so that exactly
    :func:`out_of_window_pages` of them are freed (the rest kept); it becomes ``CHUNKED``, its window lock kept."""
    op = "cache_unfinished_req"
    req = _request(state, op, rid)
    require(req.status is ReqStatus.RUNNING, op, "rid", f"request {rid} is {req.status.value}, not running")
    require(req.prefix_len + req.extend_len < req.prompt_len, op, "rid",
            f"request {rid} computed its whole prompt ({req.prompt_len} tokens): cache_finished_req, not "
            "cache_unfinished_req")
    # the chunk's forward runs between rounds: after prepare_for_extend closed its round, before the next opens
    require(state.adder is None, op, "state", "a round is open (the chunk's forward runs between rounds)")
    w, p = state.config.sliding_window, state.config.page_size
    done = own_len(state, rid)
    freed = out_of_window_pages(done + req.extend_len, window=w, page_size=p) - \
        out_of_window_pages(done, window=w, page_size=p)
    cached = req.model_copy(update={"status": ReqStatus.CHUNKED, "prefix_len": req.prefix_len + req.extend_len,
                                    "extend_len": 0, "swa_pages": req.swa_pages - freed})
    return _set_request(state, rid, cached).model_copy(update={"available": state.available + freed})


def cache_finished_req(state: AdmissionState, rid: int) -> AdmissionState:
    """Completion of a request whose prompt is done: every page it holds goes back to the pool and its window lock is
    released (a chunked request with prompt left cannot finish: :class:`InvalidOperation`)."""
    op = "cache_finished_req"
    req = _request(state, op, rid)
    require(req.status is ReqStatus.RUNNING, op, "rid", f"request {rid} is {req.status.value}, not running")
    require(req.prefix_len + req.extend_len == req.prompt_len, op, "rid",
            f"request {rid} has {req.prompt_len - req.prefix_len - req.extend_len} prompt tokens left after its "
            "chunk: cache_unfinished_req, not cache_finished_req")
    state = dec_lock_ref(state, req.locked)
    done = req.model_copy(update={"status": ReqStatus.FINISHED, "locked": (), "swa_pages": 0})
    return _set_request(state, rid, done).model_copy(update={"available": state.available + req.swa_pages})


# ---------------------------------------------------------------- invariants


def check_admission(state: AdmissionState) -> None:
    """Accounting ``available + evictable + locked == swa_pages`` (§1.4), each request holding the pages of its own
    tokens less those freed out of the window (:func:`out_of_window_pages`), and balanced lock refs; raises
    :class:`InvariantViolation`."""
    c = state.config
    ev, locked = swa_evictable_pages(state), swa_locked_pages(state)
    ensure(state.available >= 0 and state.available + ev + locked == c.swa_pages, "accounting",
           f"available {state.available} + evictable {ev} + locked {locked} != {c.swa_pages} SWA pages")
    for rid, r in enumerate(state.requests):
        want = _own_pages(state, rid)
        ensure(r.swa_pages == want, "request_pages",
               f"request {rid} ({r.status.value}) holds {r.swa_pages} SWA pages, not the {want} of its own tokens "
               "less those freed out of the window")
    holders = [r.locked for r in state.requests]
    for i, n in enumerate(state.nodes):
        count = sum(h.count(i) for h in holders)
        ensure(n.lock_ref == count, "lock_ref", f"node {i}: lock_ref {n.lock_ref}, {count} lock(s) hold it")
        _check_node(c, state.nodes, i, n, invariant=True)


def check_admission_snapshot(snap: AdmissionSnapshot) -> None:
    """The pages behind a snapshot: a device SWA node holds ``length / P`` pages, any other node none; a request holds
    its ``swa_pages``; nodes, requests and the free list partition the pool's pages ``1..swa_pages`` (an admitted
    request really allocated; nothing leaked or shared). Raises :class:`InvariantViolation`."""
    st, p = snap.state, snap.state.config.page_size
    ensure(len(snap.node_pages) == len(st.nodes) and len(snap.request_pages) == len(st.requests), "page_table",
           f"{len(snap.node_pages)} node rows for {len(st.nodes)} nodes, {len(snap.request_pages)} request rows for "
           f"{len(st.requests)} requests")
    for i, (n, pages) in enumerate(zip(st.nodes, snap.node_pages, strict=True)):
        want = n.length // p if n.swa is SwaValue.DEVICE else 0
        ensure(len(pages) == want, "page_table", f"node {i} ({n.swa.value} SWA, {n.length} tokens) holds "
                                                 f"{len(pages)} SWA pages, not {want}")
    for rid, (r, pages) in enumerate(zip(st.requests, snap.request_pages, strict=True)):
        ensure(len(pages) == r.swa_pages, "page_table",
               f"request {rid} holds {len(pages)} SWA pages, not {r.swa_pages}")
    ensure(len(snap.free_pages) == st.available, "page_table",
           f"{len(snap.free_pages)} pages on the free list, available {st.available}")
    every = [q for row in (*snap.node_pages, *snap.request_pages) for q in row] + list(snap.free_pages)
    ensure(sorted(every) == list(range(1, st.config.swa_pages + 1)), "page_table",
           f"node, request and free pages do not partition pages 1..{st.config.swa_pages}: "
           f"{len(every)} listed, {len(set(every))} distinct")


def _own_pages(state: AdmissionState, rid: int) -> int:
    """The pages request ``rid`` holds by the rules: those of its own tokens (the running chunk's included) less the
    out-of-window ones freed; none while waiting or finished."""
    r, c = state.requests[rid], state.config
    if r.status in (ReqStatus.WAITING, ReqStatus.FINISHED):
        return 0
    done = own_len(state, rid)
    allocated = done + (r.extend_len if r.status is ReqStatus.RUNNING else 0)
    return ceil_div(allocated, c.page_size) - out_of_window_pages(done, window=c.sliding_window, page_size=c.page_size)


# ---------------------------------------------------------------- preconditions


def _check_node(config: AdmissionConfig, nodes: Sequence[Node], i: int, n: Node, *, invariant: bool = False) -> None:
    p = config.page_size
    problems = []
    if not (-1 <= n.parent < len(nodes) and n.parent != i):
        problems.append(f"parent {n.parent} is not a node")
    elif not invariant and n.parent >= i:
        problems.append(f"parent {n.parent} is not listed before it")
    if n.length < p or n.length % p:
        problems.append(f"length {n.length} is not a positive multiple of page_size {p}")
    if not n.full_on_device and n.swa is SwaValue.DEVICE:
        problems.append("SWA on device without Full KV on device")
    if n.full_on_device and n.parent >= 0 and not nodes[n.parent].full_on_device:
        problems.append("Full KV on device under a node whose Full KV is on host")
    if n.lock_ref < 0:
        problems.append(f"lock_ref {n.lock_ref} < 0")
    if problems:
        if invariant:
            ensure(False, "tree", f"node {i}: " + "; ".join(problems))
        raise ConfigError("AdmissionState", "nodes", f"node {i}: " + "; ".join(problems))


def _check_node_id(state: AdmissionState, op: str, node: int) -> None:
    require(0 <= node < len(state.nodes), op, "node", f"node {node} out of range [0, {len(state.nodes)})")


def _open_adder(state: AdmissionState, op: str) -> PrefillAdder:
    if state.adder is None:  # the round's operations need its adder
        raise InvalidOperation(op, "state", "no round is open (get_new_batch_prefill first)")
    return state.adder


def _request(state: AdmissionState, op: str, rid: int) -> Request:
    require(0 <= rid < len(state.requests), op, "rid", f"request {rid} out of range [0, {len(state.requests)})")
    return state.requests[rid]


def _set_request(state: AdmissionState, rid: int, req: Request) -> AdmissionState:
    reqs = list(state.requests)
    reqs[rid] = req
    return state.model_copy(update={"requests": tuple(reqs)})

"""``tp_prefetch``: one L3 prefetch of one request on N tensor-parallel ranks, as pure operations.

Models PR #27264 and its successors (sglang_semantics.md §6.1-§6.7, §7 T1-T5, §8 item 9, §9 S10;
upstream_0523_vllm_fuzz.md §2 for SGLang 0.5.23). Each of the N ranks (1..8) prefetches the same request
key from storage at its own pace; the ranks agree through MIN/MAX all-reduces, then each rank inserts
the fetched Full prefix into its own host tree and attaches (or releases) its SWA window buffer.

**What one rank brings** (:class:`RankProgress`): its storage hit (pages its storage query reports),
the Full pages its IO thread has loaded when the scheduler checks (its pace, a failure or a timeout
stops it), whether its IO thread has finished (``io_done``: all Full pages and, if it reached them,
its sidecar transfers), whether its deadline passed, its termination policy (``best_effort`` /
``wait_complete`` / ``timeout``), its transfer set (the sidecar pools it built transfers for,
``comp_xfers``: SWA and/or Mamba, in component order), which window-buffer pages' SWA fetch fails
(``swa_missing``, buffer page indices: the *positions*), whether its Mamba fetch fails, whether
it registered the prefetch at all (``registered=False``: its build returned ``[]`` and aborted,
§6.2, so it reaches no collective), and, in 0.5.23, how many Full host pages it has free when the
synced hit is staged (``host_free_pages``; ``None``: enough).

**The operations**, one system step each, named as in SGLang (leading underscores dropped); the
pure per-rank functions they are made of are what a multi-process runtime calls on each rank:

1. :func:`sync_prefetch_hit_query` -- the storage-hit MIN (§6.2's IO thread; 0.5.23's
   ``_sync_prefetch_hit_query``): per rank :func:`pack_hit_query`, then :func:`all_reduce`, then
   :func:`unpack_hit_query`.
2. :func:`page_transfer` -- each rank's IO thread against the synced hit (§6.2; 0.5.23's
   ``_page_transfer`` / ``_page_transfer_sidecar``): per rank :func:`rank_page_transfer`.
3. :func:`can_terminate_prefetch` -- the termination vote (§6.3 step 2; 0.5.23's
   ``_can_terminate_prefetch``): per rank :func:`pack_terminate_vote`, :func:`all_reduce` MAX,
   :func:`rank_proceeds`.
4. :func:`reduce_prefetch_ack` -- the packed MIN of ``[completed, hit pages per sidecar pool...]``
   (§6.3 step 5, inside ``check_prefetch_progress`` in the #27264 code; 0.5.23's
   ``_reduce_prefetch_ack``, two collectives): per rank :func:`pack_prefetch_ack`,
   :func:`all_reduce`, :func:`unpack_prefetch_ack`.
5. :func:`handle_prefetch_result` -- on each rank that proceeds (§6.3 steps 6-8; 0.5.23's
   ``_handle_prefetch_result`` with ``_check_hybrid_prefetch_result``): per rank
   :func:`rank_handle_prefetch_result`, which calls :func:`insert_host` (``_insert_helper_host`` /
   ``tree_core.insert_host``) and :func:`commit_prefetch` (the SWA component's ``_commit_prefetch``,
   §6.4: the attach-or-release walk with node splits).

:func:`check_prefetch_progress` runs the five in order and stops at the first mismatched collective
(phase ``MISMATCHED``) or when no rank may terminate yet (phase ``WAITING``).
:func:`check_tp_prefetch` raises :class:`InvariantViolation` for T1-T5 on a final state (T4 includes R5-d: a
window page released by the scheduler while its IO thread still writes it), :func:`check_hit_counts` for R5-c, and
:func:`check_rank_commit` checks one rank's commit on its own (a runtime's per-rank snapshot can be checked by it).

**Mirroring it on N processes** (the runtime and its suite): each rank holds its :class:`RankProgress` and runs
the per-rank functions in this order, with one real ``all_reduce`` where the reference calls :func:`all_reduce`:
``pack_hit_query`` -> all-reduce -> ``unpack_hit_query``; ``rank_page_transfer``; ``pack_terminate_vote`` ->
all-reduce (only the ranks whose vector is not ``None``) -> ``rank_proceeds`` (``all_finished``: every rank's
IO finished, which 0.5.23 learns from its ACK drain); ``pack_prefetch_ack`` -> one or two all-reduces ->
``unpack_prefetch_ack``; ``rank_handle_prefetch_result``. A rank whose pack returns ``None`` does not call that
collective: where other ranks do, the reference's verdict is :class:`CollectiveMismatch` (on gloo: a hang or a
size error, so the runtime needs a bounded timeout per collective). The reference's
:attr:`PrefetchState.collectives` lists every call with each rank's values and the result, for comparing call by
call.

**The collectives.** :func:`all_reduce` is a pure function over the N ranks' packed vectors
(:class:`Packed`: the reduce op, the values, the slot names). A rank set whose calls differ in presence
(a rank that skips it), op or shape is the typed outcome :class:`CollectiveMismatch` naming the ranks and
the shapes (T5: on a real group, an error or a hang), never an exception. Calls with the same op and shape
but different slot names are reduced elementwise, as a real all-reduce does: the state records the
call (:attr:`CollectiveCall.mixed`) and :func:`check_tp_prefetch` reports it (T5, silently). Packed
layouts (slot names; values are pages, or 0/1 flags):

* ``sync_prefetch_hit_query``: #27264 era ``[hit]``; 0.5.23 ``[flag_0 .. flag_R] + [kv, mamba, swa]`` when
  the rank has a trailing-pages transfer (SWA or Mamba: one restorable flag per prefix length of the
  ``R``-page request, ``flag_0 = 1``, ``flag_i = 1`` for ``i <= hit``), else ``[hit] + [kv, mamba, swa]``;
  the pool verdicts are the rank's hit for KV and its transfer pools, ``-1`` (``_NO_POOL_VERDICT``) for a
  pool it omitted. MIN.
* ``can_terminate_prefetch``: #27264 era ``[not_can, terminated]`` MAX on every rank that is not
  ``best_effort``; 0.5.23 ``[deadline]`` MAX on ``timeout`` ranks only.
* ``reduce_prefetch_ack``: ``pre_27264`` ``[completed]``; ``upstream_27264`` ``[completed, hits of each
  pool in the rank's transfer set, in component order]`` (its length is ``1 + |transfers|``: R5-a);
  0.5.23 ``[completed]`` on every rank, then ``[kv, mamba, swa]`` (``PoolName`` order, 0 for a pool the
  rank did not fetch) on the ranks with sidecar transfers, once their IO threads finished. MIN.

**Variants** (:class:`TPPrefetchVariant`, one typed parameter of the config):

* ``pre_27264`` (inferred "before", §6.6): only ``completed`` is synced; each rank's SWA hit count stays
  rank-local, so one rank can attach a window another drops (S10);
* ``upstream_27264`` (§6.3/§6.4, 0.5.13): the packed MIN writes the cross-rank minimum of each sidecar
  pool's hits back before the commit; hits are counted as the sum of successes (R5-c);
* ``upstream_0523`` (upstream_0523_vllm_fuzz.md §2.1/§2.2): the reductions live in the cache controller
  (hit query with flags and pool verdicts, progressive ACKs, a pool-hit ACK packed over ``PoolName``);
  hits count the leading run (#31443); all-or-nothing for the whole prefetch
  (``_check_hybrid_prefetch_result``: ``completed == `` the rank's staged length and every sidecar count
  equals its keys, else nothing is inserted and every slot is released); sidecar slots are released by the
  scheduler only when ``pool_transfers_done``, else by the IO thread (#31668's ownership bit); the
  termination vote is a MAX of deadlines for ``timeout`` only; a root-anchored request shorter than the
  window prefetches a sub-window (#34798). Staging happens at hit time (``_try_alloc_storage_hit``, URC:3109):
  a synced hit below the prefetch threshold (one page here) revokes the prefetch on every rank before any IO
  (phase ``REVOKED``: no transfer, no ACK, no commit); otherwise each rank stages ``min(hit, host_free_pages)``
  Full pages (``allow_partial``: a rank short of host memory truncates its own ``hash_value`` *after* the
  sync, F6) and an SWA window buffer of ``min(window keys, hit)`` pages (``_alloc_prefetch_aux_staging``), so
  at the root a hit shorter than the window gets a whole (short) window that the commit attaches. ACKs are
  emitted when a rank's IO thread finishes its batch (one batch here) and reduced rank-min, so a check at which
  some rank's IO is still in flight reduces no ACK (the scheduler sees 0 completed);
* ``sum_hits`` (R5-c): ``upstream_0523`` counting hits as the sum of successes. For SWA (all-or-nothing)
  it decides the same trees; the synced count is no longer a prefix every rank fetched;
* ``best_effort_release`` (R5-d): ``upstream_0523`` whose discard path releases the sidecar buffer even
  while the IO thread still writes it (``pool_transfers_done`` ignored): a slot released, then written.

The #27264-era variants also show R5-d: a ``best_effort`` rank, or any rank once another rank's IO
*terminated* (``any terminated`` in §6.3 step 2 skips the "transfers not done" guard), drops and releases
an SWA buffer its IO thread is still writing. [Model finding, from §6.3's description of the vote; to be
confirmed against the real code.] In 0.5.23 a rank with a trailing-pages transfer packs a longer hit query
than a rank without one, and only ranks with sidecar transfers emit the pool-hit ACK: T5 remains when
transfer sets differ. [Inferred from reading 0.5.23's ``_sync_prefetch_hit_query`` and
``_page_transfer_sidecar``.]

**The results per rank** (:class:`RankCommit`): its host path below the anchor (:class:`TreeNode`: length,
Full inserted now or already present, SWA host value, the window-buffer pages attached now and the token
position whose SWA KV they hold), the split points, and the owner of every host slot it holds for the
prefetch (:class:`SlotOwner`), Full host pages of the request and SWA window-buffer pages, and the buffer
pages released by the scheduler that its IO thread still writes (``written_after_release``).
Full host pages (T4): ``[0, prefix)`` freed (already present), ``[prefix, M)`` in the tree, ``[M,
completed)`` on the release queue, ``[completed, R)`` released by the IO thread (the tail it truncated to
the storage hit, and, inferred, what it loaded after an early termination; §6.5 T4). SWA buffer pages:
each attached to exactly one node or released (§6.4).

[Differs from SGLang:]

* one check of one prefetch: a check that says "wait" ends the run (phase ``WAITING``); the caller runs it
  again with later progress (:func:`initial_state` with ``continues``: the storage hit was synced once and the
  buffers are kept, so the continued check makes no hit-query collective). The progress is a snapshot at
  check time; ``io_done`` says whether the IO thread finished, not how far an in-flight write got;
* positions are relative to the anchor and whole pages (keys are page-aligned); the host tree is the path
  of nodes along the key below the anchor (:attr:`TPPrefetchConfig.existing`, the same on every rank
  before the prefetch, each with a Full host value); side branches, LRU lists, lock refs and the device
  tree are not modelled;
* storage is contiguous: a rank's restorable prefixes are pages ``1..hit`` (0.5.23's sparse boundaries
  are not modelled), so 0.5.23's flag MIN equals the MIN of the hits; pool verdicts feed storage beliefs
  (not modelled) and count only for the shape;
* the Mamba component's commit is not modelled: a Mamba transfer (one trailing checkpoint page) adds its
  hit to the packed vectors and, in 0.5.23, to the all-or-nothing check;
* 0.5.23 reduces one progress ACK per prefetch (upstream: one per storage batch, the same MIN of the
  running count) and the ACK drain is rank-min, so every rank applies the same ACKs; the reductions run
  after the termination vote here (0.5.23 reduces them in its sync thread as the IO goes: its vote reads
  none of them, so the order changes nothing the model observes); PP is 1;
* the rank-local shrink of ``prefetch_length`` (§6.2) is expressed only through that rank's transfer set
  and storage hit before 0.5.23 (every rank holds ``request_pages`` Full host pages from the start), and
  through ``host_free_pages`` in 0.5.23 (F6). A rank with no Full host page free at hit time revokes the
  prefetch alone (F7: its ACKs then pair with the next request's on the other ranks); that needs ACK queues
  across prefetches and is not modelled (``host_free_pages >= 1``), nor is an SWA staging failure;
* the prefetch threshold is one page (0.5.23's default is 256 tokens): a synced hit of 0 pages revokes;
* the #27264-era packed MIN runs for any world size (upstream skips it when ``tp_world_size == 1``; a
  reduce over one rank is the identity).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvproof.reference.arith import ceil_div
from kvproof.reference.config import ConfigModel
from kvproof.reference.errors import ConfigError, InvalidOperation, ensure, require

__all__ = [
    "COMPONENT_ORDER",
    "MAX_WORLD_SIZE",
    "NO_POOL_VERDICT",
    "POOL_ORDER",
    "CollectiveCall",
    "CollectiveMismatch",
    "HostNode",
    "IOResult",
    "InsertResult",
    "Packed",
    "Phase",
    "PhaseReport",
    "PoolName",
    "PrefetchState",
    "RankCommit",
    "RankProgress",
    "RankSnapshot",
    "RankState",
    "ReduceOp",
    "SlotOwner",
    "SwaCommit",
    "TPPrefetchConfig",
    "TPPrefetchGroup",
    "TPPrefetchSnapshot",
    "TPPrefetchVariant",
    "TerminationPolicy",
    "TreeNode",
    "all_reduce",
    "can_terminate_prefetch",
    "check_hit_counts",
    "check_prefetch_progress",
    "check_rank_commit",
    "check_tp_prefetch",
    "commit_prefetch",
    "count_pool_hits",
    "handle_prefetch_result",
    "initial_state",
    "insert_host",
    "pack_hit_query",
    "pack_prefetch_ack",
    "pack_terminate_vote",
    "page_transfer",
    "path_after",
    "phase_report",
    "rank_handle_prefetch_result",
    "rank_page_transfer",
    "rank_proceeds",
    "rank_target",
    "reduce_prefetch_ack",
    "staged_pages",
    "swa_buffer_pages",
    "sync_prefetch_hit_query",
    "tree_shape",
    "unpack_hit_query",
    "unpack_prefetch_ack",
    "window_pages",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
#: The largest tensor-parallel group the model (and its Z3 twin) covers.
MAX_WORLD_SIZE = 8
#: 0.5.23's ``_NO_POOL_VERDICT``: the verdict slot of a pool the rank omitted from its hit query.
NO_POOL_VERDICT = -1


class TPPrefetchVariant(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """Which protocol the ranks run (module docstring)."""

    PRE_27264 = "pre_27264"  # only completed synced; SWA hits rank-local (S10)
    UPSTREAM_27264 = "upstream_27264"  # packed MIN [completed, hits per sidecar pool], hits counted by sum
    UPSTREAM_0523 = "upstream_0523"  # reductions in the controller, leading run, all-or-nothing, ownership bit
    SUM_HITS = "sum_hits"  # R5-c: upstream_0523 counting hits by sum
    BEST_EFFORT_RELEASE = "best_effort_release"  # R5-d: upstream_0523 releasing a buffer the IO thread writes

    @property
    def protocol_0523(self) -> bool:
        """The 0.5.23 protocol (its reductions, its vote, all-or-nothing)."""
        return self in (TPPrefetchVariant.UPSTREAM_0523, TPPrefetchVariant.SUM_HITS,
                        TPPrefetchVariant.BEST_EFFORT_RELEASE)

    @property
    def leading_run(self) -> bool:
        """Hits count the leading run of successes (#31443), not their sum."""
        return self in (TPPrefetchVariant.UPSTREAM_0523, TPPrefetchVariant.BEST_EFFORT_RELEASE)


class TerminationPolicy(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """``prefetch_stop_policy`` (§6.3 step 2)."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


class PoolName(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """The pools the model knows, in 0.5.23's ``PoolName`` order (KV, MAMBA, SWA; 0.5.23 has 18 members)."""

    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"


#: 0.5.23's packing order of the pool slots (``for pool in PoolName``).
POOL_ORDER: tuple[PoolName, ...] = (PoolName.KV, PoolName.MAMBA, PoolName.SWA)
#: The #27264-era order of ``comp_xfers`` (component order: SWA before Mamba; assumed).
COMPONENT_ORDER: tuple[PoolName, ...] = (PoolName.SWA, PoolName.MAMBA)


class ReduceOp(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    MIN = "min"
    MAX = "max"


class Phase(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """Where one check of the prefetch stands; ``WAITING``, ``MISMATCHED``, ``REVOKED`` and ``COMMITTED`` end it."""

    STARTED = "started"
    QUERIED = "queried"  # sync_prefetch_hit_query done
    TRANSFERRED = "transferred"  # page_transfer done
    DECIDED = "decided"  # can_terminate_prefetch: some rank proceeds
    REDUCED = "reduced"  # reduce_prefetch_ack done
    COMMITTED = "committed"  # handle_prefetch_result done
    WAITING = "waiting"  # no rank may terminate yet
    MISMATCHED = "mismatched"  # a collective's calls differ across ranks (T5)
    REVOKED = "revoked"  # 0.5.23: the synced hit is below the prefetch threshold: revoked on every rank, no IO


class SlotOwner(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """Who holds a host slot of the prefetch after the check (T4)."""

    TREE = "tree"  # a host tree node's value (Full KV, or an attached SWA slice)
    FREED = "freed"  # freed now by the scheduler (already present; an SWA slice released by the commit)
    RELEASE_QUEUE = "release_queue"  # queued for release by the scheduler
    IO_THREAD = "io_thread"  # the IO thread releases it
    HELD = "held"  # still held by an ongoing prefetch (the rank waits)


# ---------------------------------------------------------------- configuration and inputs


class HostNode(BaseModel):
    """A host tree node along the key below the anchor before the prefetch (tokens, whole pages)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    length: int = Field(ge=1)
    swa_host: bool = False  # has an SWA host value (False: an SWA tombstone the commit may fill)


class TPPrefetchConfig(ConfigModel):
    """The geometry, the request, the host path before the prefetch (identical on every rank) and the variant."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    page_size: int = Field(ge=1, description="P: tokens per page")
    sliding_window: int = Field(ge=1, description="W: sliding window in tokens (ceil(W / P) window pages)")
    request_pages: int = Field(ge=1, description="R: pages of the prefetch key (relative to the anchor)")
    anchor_is_root: bool = False
    existing: tuple[HostNode, ...] = ()
    variant: TPPrefetchVariant = TPPrefetchVariant.UPSTREAM_27264

    @model_validator(mode="after")
    def _existing_on_the_key(self) -> TPPrefetchConfig:
        for i, node in enumerate(self.existing):
            if node.length % self.page_size:
                raise ConfigError("TPPrefetchConfig", "existing",
                                  f"node {i}: length {node.length} is not a multiple of page_size {self.page_size}")
        total = sum(n.length for n in self.existing)
        if total > self.request_pages * self.page_size:
            raise ConfigError("TPPrefetchConfig", "existing", f"the nodes cover {total} tokens, more than the "
                              f"{self.request_pages * self.page_size}-token key")
        return self

    @property
    def sw_pages(self) -> int:
        """``ceil(W / P)``: the pages one full window spans (§6.2)."""
        return ceil_div(self.sliding_window, self.page_size)

    def with_variant(self, variant: TPPrefetchVariant | str) -> TPPrefetchConfig:
        return self.model_copy(update={"variant": TPPrefetchVariant(variant)})


class RankProgress(ConfigModel):
    """One rank's own progress for the prefetch when the scheduler checks it (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    storage_hit: int = Field(ge=0, description="pages its storage query reports")
    full_pages: int = Field(ge=0, description="Full pages its IO thread has loaded (capped at the synced hit)")
    io_done: bool = True
    deadline_passed: bool = False
    policy: TerminationPolicy = TerminationPolicy.WAIT_COMPLETE
    transfers: tuple[PoolName, ...] = (PoolName.SWA,)
    swa_missing: tuple[int, ...] = ()  # window-buffer pages whose SWA fetch fails
    mamba_missing: bool = False
    registered: bool = True
    host_free_pages: int | None = Field(default=None, ge=1, description="0.5.23: Full host pages free at hit time")

    @model_validator(mode="after")
    def _transfers(self) -> RankProgress:
        order = [p for p in COMPONENT_ORDER if p in self.transfers]
        if list(self.transfers) != order:
            raise ConfigError("RankProgress", "transfers", f"must be sidecar pools in component order "
                              f"{[p.value for p in COMPONENT_ORDER]} without repeats, got "
                              f"{[p.value for p in self.transfers]}")
        if list(self.swa_missing) != sorted(set(self.swa_missing)) or any(i < 0 for i in self.swa_missing):
            raise ConfigError("RankProgress", "swa_missing", f"must be increasing page indices >= 0, got "
                              f"{list(self.swa_missing)}")
        return self


def window_pages(config: TPPrefetchConfig, progress: RankProgress) -> int:
    """The rank's SWA window keys (0 without an SWA transfer): ``ceil(W / P)`` (§6.2); 0.5.23 at the root with a
    request shorter than the window: the request (``prepare_prefetch``, #34798). Before 0.5.23 this is also its
    window buffer, allocated at the start; 0.5.23 stages :func:`swa_buffer_pages` at hit time."""
    if PoolName.SWA not in progress.transfers:
        return 0
    if config.variant.protocol_0523 and config.request_pages < config.sw_pages:
        return config.request_pages
    return config.sw_pages


def staged_pages(config: TPPrefetchConfig, progress: RankProgress, synced_hit: int) -> int:
    """The Full host pages the rank stages for the prefetch, its expected length: ``request_pages`` before 0.5.23
    (allocated at the start, §6.1); 0.5.23 ``min(synced hit, host_free_pages)`` at hit time (``allocate_storage_hit``
    with ``allow_partial``, after the sync: F6 when a rank is short). 0 for a rank that never registered."""
    if not progress.registered:
        return 0
    if not config.variant.protocol_0523:
        return config.request_pages
    free = progress.host_free_pages
    return synced_hit if free is None else min(synced_hit, free)


def swa_buffer_pages(config: TPPrefetchConfig, progress: RankProgress, synced_hit: int) -> int:
    """The rank's SWA window-buffer pages: :func:`window_pages` before 0.5.23; 0.5.23 ``min(window keys, synced
    hit)`` at hit time (``_alloc_prefetch_aux_staging``, URC:2914). 0 for a rank that never registered."""
    if not progress.registered:
        return 0
    n = window_pages(config, progress)
    return min(n, synced_hit) if config.variant.protocol_0523 else n


# ---------------------------------------------------------------- the collective


class Packed(BaseModel):
    """What one rank passes to one all-reduce: the op, the values, each slot's name."""

    model_config = _FROZEN

    op: ReduceOp
    values: tuple[int, ...]
    layout: tuple[str, ...]

    @model_validator(mode="after")
    def _named(self) -> Packed:
        if len(self.values) != len(self.layout):
            raise ConfigError("Packed", "layout", f"{len(self.layout)} names for {len(self.values)} values")
        return self

    def shape(self) -> str:
        return f"all_reduce({self.op.value.upper()}) of {len(self.values)} value(s) [{', '.join(self.layout)}]"


class CollectiveCall(BaseModel):
    """One all-reduce every participating rank made: what each passed (``None``: not a participant) and the result."""

    model_config = _FROZEN

    name: str
    op: ReduceOp
    packed: tuple[Packed | None, ...]
    result: tuple[int, ...]

    @property
    def mixed(self) -> bool:
        """Same op and shape, different slot names: reduced elementwise all the same (T5, silently)."""
        return len({p.layout for p in self.packed if p is not None}) > 1


class CollectiveMismatch(BaseModel):
    """An all-reduce whose calls differ across ranks in presence, op or shape (T5): an error or a hang upstream."""

    model_config = _FROZEN

    name: str
    packed: tuple[Packed | None, ...]  # per rank; None: the rank does not call it

    def groups(self) -> dict[str, tuple[int, ...]]:
        """Each distinct call (``"no call"`` for a rank that skips it) and the ranks making it."""
        out: dict[str, list[int]] = {}
        for rank, p in enumerate(self.packed):
            key = "no call" if p is None else f"{p.op.value.upper()} shape ({len(p.values)},)"
            out.setdefault(key, []).append(rank)
        return {k: tuple(v) for k, v in out.items()}

    def describe(self) -> str:
        parts = []
        for rank, p in enumerate(self.packed):
            parts.append(f"rank {rank}: " + ("no call (it never reaches this collective: the others hang)"
                                             if p is None else p.shape()))
        return f"mismatched collective {self.name}: " + "; ".join(parts)


def all_reduce(name: str, packed: Sequence[Packed | None]) -> CollectiveCall | CollectiveMismatch | None:
    """``torch.distributed.all_reduce`` over the ranks' packed vectors (``None``: a rank that does not call it).

    No rank calls: ``None`` (no collective). The calls differ in presence, op or length:
    :class:`CollectiveMismatch`. Otherwise the elementwise MIN or MAX, the same on every rank.
    """
    require(1 <= len(packed) <= MAX_WORLD_SIZE, "all_reduce", "packed",
            f"{len(packed)} ranks, outside 1..{MAX_WORLD_SIZE}")
    calls = [p for p in packed if p is not None]
    if not calls:
        return None
    first = calls[0]
    if len(calls) != len(packed) or any(p.op is not first.op or len(p.values) != len(first.values) for p in calls):
        return CollectiveMismatch(name=name, packed=tuple(packed))
    reduce = min if first.op is ReduceOp.MIN else max
    result = tuple(reduce(column) for column in zip(*(p.values for p in calls), strict=True))
    return CollectiveCall(name=name, op=first.op, packed=tuple(packed), result=result)


# ---------------------------------------------------------------- the state


class TreeNode(BaseModel):
    """A node of a rank's host path below the anchor after the check (tokens)."""

    model_config = _FROZEN

    length: int
    swa_host: bool = False  # has an SWA host value (already, or attached now)
    inserted: bool = False  # its Full host value was inserted by this prefetch (False: already present)
    swa_pages: tuple[int, ...] = ()  # window-buffer pages attached here now
    swa_from: int | None = None  # the token position whose SWA KV those pages hold


class InsertResult(BaseModel):
    """``_insert_helper_host``'s result (§6.3 step 6): the path after the insert and where the prefix ends."""

    model_config = _FROZEN

    nodes: tuple[TreeNode, ...]
    prefix_len: int  # tokens already present
    total_len: int  # tokens inserted up to (relative to the anchor)
    target: int | None  # index of the node ending at total_len (None: nothing inserted, total_len == 0)
    split: int | None  # token offset where an existing node was split (None: none)


class SwaCommit(BaseModel):
    """``_commit_prefetch``'s result (§6.4): the path, each window-buffer page's owner, the split it made."""

    model_config = _FROZEN

    nodes: tuple[TreeNode, ...]
    swa_slots: tuple[SlotOwner, ...]
    attached: bool
    split: int | None


class IOResult(BaseModel):
    """One rank's IO thread against the synced hit (pages)."""

    model_config = _FROZEN

    completed: int  # Full pages completed: min(full_pages, synced hit)
    reached_sidecars: bool  # all Full pages completed: the sidecar step runs (or ran)
    keys: dict[PoolName, int]  # keys of each sidecar transfer (SWA: the last min(n, hit) hashes; Mamba: 1)
    hits: dict[PoolName, int]  # recorded success counts (pool_storage_result; 0 until the IO thread finished)
    in_flight: tuple[int, ...]  # window-buffer pages its IO thread still writes
    finished: bool  # the IO thread ended (io_done, or all Full pages and nothing more to fetch)


class RankCommit(BaseModel):
    """What one rank holds after handle_prefetch_result (module docstring)."""

    model_config = _FROZEN

    nodes: tuple[TreeNode, ...]
    prefix_len: int  # tokens
    total_len: int  # tokens inserted up to (0 when the prefetch was discarded)
    attached: bool
    discarded: bool  # 0.5.23: the all-or-nothing check failed, nothing inserted
    insert_split: int | None  # token offset where the insert split an existing node (None: none)
    swa_split: int | None  # token offset where the commit split a tombstone at the window start (None: none)
    full_slots: tuple[SlotOwner, ...]  # per Full host page of the request
    swa_slots: tuple[SlotOwner, ...]  # per window-buffer page
    written_after_release: tuple[int, ...]  # window-buffer pages released by the scheduler, still written by IO


class RankState(BaseModel):
    """One rank through the check: its progress and what each operation derived for it."""

    model_config = _FROZEN

    progress: RankProgress
    synced_hit: int | None = None  # pages
    staged: int | None = None  # Full host pages staged for the prefetch (staged_pages); None: not yet (0.5.23)
    window: int | None = None  # SWA window-buffer pages (swa_buffer_pages); None: not yet (0.5.23)
    io: IOResult | None = None
    proceeds: bool | None = None
    min_completed: int | None = None  # pages: the completed count the insert uses
    synced_hits: dict[PoolName, int] | None = None  # the sidecar counts the commit reads
    transfers_done: bool = False  # pool_transfers_done as the scheduler sees it (0.5.23: pool ACK applied)
    commit: RankCommit | None = None


class PrefetchState(BaseModel):
    """All ranks through one check of the prefetch."""

    model_config = _FROZEN

    config: TPPrefetchConfig
    ranks: tuple[RankState, ...]
    phase: Phase = Phase.STARTED
    collectives: tuple[CollectiveCall, ...] = ()
    mismatch: CollectiveMismatch | None = None
    continued: bool = False  # a check of a prefetch an earlier check left waiting: the hit was synced then

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def initial_state(config: TPPrefetchConfig, ranks: Sequence[RankProgress], *,
                  continues: PrefetchState | None = None) -> PrefetchState:
    """The check before any collective; :class:`InvalidOperation` for a progress that does not fit the config.

    ``continues``: the state of the check that ended waiting on this prefetch. The new check keeps what the hit query
    decided then (every rank's synced hit, its staging, its window buffer: the storage is queried once per prefetch),
    so each rank's request, storage hit, policy, transfer set, registration and host capacity must be the same; only
    its pace moves on (loaded pages never fewer, a passed deadline stays passed, a finished IO thread stays as it
    was).
    """
    op = "initial_state"
    require(1 <= len(ranks) <= MAX_WORLD_SIZE, op, "ranks", f"{len(ranks)} ranks, outside 1..{MAX_WORLD_SIZE}")
    require(any(p.registered for p in ranks), op, "ranks", "no rank registered the prefetch: there is nothing to check")
    if continues is not None:
        require(continues.phase is Phase.WAITING, op, "continues",
                f"only a check that ended waiting continues (it ended {continues.phase.value})")
        require(continues.config == config and len(continues.ranks) == len(ranks), op, "continues",
                "a continued check runs on the same request, host path and group")
        for r, (before, p) in enumerate(zip(continues.ranks, ranks, strict=True)):
            same = ("storage_hit", "policy", "transfers", "registered", "host_free_pages")
            changed = [k for k in same if getattr(before.progress, k) != getattr(p, k)]
            require(not changed, op, "ranks", f"rank {r}: a continued prefetch keeps its {', '.join(changed)}")
            was = before.progress
            require(not was.io_done or p == was, op, "ranks",
                    f"rank {r}: its IO thread had finished, so its progress stays as it was")
            require(p.full_pages >= was.full_pages and p.deadline_passed >= was.deadline_passed, op, "ranks",
                    f"rank {r}: progress only moves on (loaded {was.full_pages} -> {p.full_pages} pages, deadline "
                    f"passed {was.deadline_passed} -> {p.deadline_passed})")
    for r, p in enumerate(ranks):
        where = f"rank {r}: "
        require(p.storage_hit <= config.request_pages, op, "ranks",
                where + f"storage_hit {p.storage_hit} > request_pages {config.request_pages}")
        require(p.full_pages <= config.request_pages, op, "ranks",
                where + f"full_pages {p.full_pages} > request_pages {config.request_pages}")
        if PoolName.SWA in p.transfers:
            if config.variant.protocol_0523:
                require(config.request_pages >= config.sw_pages or config.anchor_is_root, op, "ranks",
                        where + f"an SWA transfer mid-tree needs a whole window ({config.sw_pages} pages), the key "
                                f"has {config.request_pages} (prepare_prefetch builds none)")
            else:
                require(config.request_pages >= config.sw_pages, op, "ranks",
                        where + f"an SWA transfer needs floor(T / P) >= {config.sw_pages} window pages, the key has "
                                f"{config.request_pages} (build_hicache_transfers returns None)")
        n = window_pages(config, p)
        require(all(i < n for i in p.swa_missing), op, "ranks",
                where + f"swa_missing {list(p.swa_missing)} outside its {n}-page window buffer")
        require(p.host_free_pages is None or config.variant.protocol_0523, op, "ranks",
                where + "host_free_pages models 0.5.23's hit-time staging; before it every rank stages "
                        "request_pages at the start")
    if continues is not None:
        kept = tuple(before.model_copy(update={"progress": p, "io": None, "proceeds": None, "min_completed": None,
                                               "synced_hits": None, "transfers_done": False, "commit": None})
                     for before, p in zip(continues.ranks, ranks, strict=True))
        return PrefetchState(config=config, ranks=kept, continued=True)
    if config.variant.protocol_0523:  # staged at hit time
        return PrefetchState(config=config, ranks=tuple(RankState(progress=p) for p in ranks))
    return PrefetchState(config=config, ranks=tuple(
        RankState(progress=p, staged=staged_pages(config, p, 0), window=swa_buffer_pages(config, p, 0))
        for p in ranks))


# ---------------------------------------------------------------- 1. the storage-hit MIN


def _trailing(progress: RankProgress) -> bool:
    """Whether the rank built a TRAILING_PAGES transfer (SWA and Mamba both are)."""
    return bool(progress.transfers)


def pack_hit_query(config: TPPrefetchConfig, progress: RankProgress) -> Packed | None:
    """The rank's ``sync_prefetch_hit_query`` vector (module docstring); ``None`` when it never registered."""
    if not progress.registered:
        return None
    hit = progress.storage_hit
    if not config.variant.protocol_0523:
        return Packed(op=ReduceOp.MIN, values=(hit,), layout=("hit",))
    if _trailing(progress):  # one restorable flag per prefix length of the request (contiguous storage)
        flags = tuple(1 if i <= hit else 0 for i in range(config.request_pages + 1))
        head: tuple[int, ...] = flags
        names: tuple[str, ...] = tuple(f"flag_{i}" for i in range(config.request_pages + 1))
    else:
        head, names = (hit,), ("hit",)
    verdicts = tuple(hit if pool is PoolName.KV or pool in progress.transfers else NO_POOL_VERDICT
                     for pool in POOL_ORDER)
    return Packed(op=ReduceOp.MIN, values=head + verdicts, layout=names + tuple(p.value for p in POOL_ORDER))


def unpack_hit_query(config: TPPrefetchConfig, progress: RankProgress, result: Sequence[int]) -> int:
    """The synced hit in pages from the reduced vector: the hit, or the longest prefix restorable on every rank."""
    if not (config.variant.protocol_0523 and _trailing(progress)):
        return int(result[0])
    flags = result[:config.request_pages + 1]
    return max(i for i, ok in enumerate(flags) if ok)


def sync_prefetch_hit_query(state: PrefetchState) -> PrefetchState:
    """Every registered rank's storage hit, MIN-reduced: the ranks load against one synced hit (§6.2, T1).

    0.5.23 then stages at hit time (module docstring): a synced hit of 0 pages revokes the prefetch on every rank
    (``REVOKED``); otherwise each rank stages :func:`staged_pages` and :func:`swa_buffer_pages`. A continued check
    (:func:`initial_state` with ``continues``) keeps what the first check synced and staged: no collective.
    """
    op = "sync_prefetch_hit_query"
    _phase(state, op, Phase.STARTED)
    c = state.config
    if state.continued:
        return state.model_copy(update={"phase": Phase.QUERIED})
    packed = [pack_hit_query(c, r.progress) for r in state.ranks]
    call = all_reduce(op, packed)
    if isinstance(call, CollectiveMismatch):
        return state.model_copy(update={"phase": Phase.MISMATCHED, "mismatch": call})
    collectives = state.collectives if call is None else (*state.collectives, call)
    # no rank calls it (none registered): nothing to sync, nothing fetched
    hits = [0 if call is None else unpack_hit_query(c, r.progress, call.result) for r in state.ranks]
    if c.variant.protocol_0523 and call is not None and all(h == 0 for h, r in zip(hits, state.ranks, strict=True)
                                                             if r.progress.registered):
        ranks = tuple(r.model_copy(update={"synced_hit": 0, "staged": 0, "window": 0}) for r in state.ranks)
        return state.model_copy(update={"ranks": ranks, "phase": Phase.REVOKED, "collectives": collectives})
    ranks = tuple(r.model_copy(update={"synced_hit": h, "staged": staged_pages(c, r.progress, h),
                                       "window": swa_buffer_pages(c, r.progress, h)})
                  for h, r in zip(hits, state.ranks, strict=True))
    return state.model_copy(update={"ranks": ranks, "phase": Phase.QUERIED, "collectives": collectives})


# ---------------------------------------------------------------- 2. the IO threads


def count_pool_hits(results: Sequence[bool], *, leading_run: bool) -> int:
    """A pool's success count over its keys: the leading run (0.5.23's ``count_pool_hits``, #31443) or the sum of
    successes (the #27264 era's ``update_extra_pool_hit_pages``, R5-c)."""
    if leading_run:
        return next((i for i, ok in enumerate(results) if not ok), len(results))
    return sum(1 for ok in results if ok)


def rank_target(rank: RankState, op: str) -> int:
    """The Full pages the rank's IO thread fetches: the synced hit, or fewer where 0.5.23 staged fewer (F6)."""
    return min(_synced(rank, op), _staged(rank, op))


def rank_page_transfer(config: TPPrefetchConfig, rank: RankState) -> IOResult:
    """The rank's IO thread (§6.2): Full pages up to its target (:func:`rank_target`) at its pace; only if every Full
    page completed, the sidecar transfers (SWA: the last ``min(n, target)`` page hashes into the first of its ``n``
    buffer pages; Mamba: the checkpoint at the target). Their counts are recorded when it finishes; until then its
    SWA writes are in flight."""
    progress, target = rank.progress, rank_target(rank, "page_transfer")
    completed = min(progress.full_pages, target)
    reached = progress.registered and completed == target
    n = _window(rank, "page_transfer")
    keys = {PoolName.SWA: min(n, target) if reached else n, PoolName.MAMBA: min(1, target) if reached else 1}
    keys = {p: k for p, k in keys.items() if p in progress.transfers}
    finished = progress.io_done or (reached and not progress.transfers)
    hits = dict.fromkeys(progress.transfers, 0)
    in_flight: tuple[int, ...] = ()
    if reached and progress.transfers:
        swa = [i not in progress.swa_missing for i in range(keys.get(PoolName.SWA, 0))]
        if progress.io_done:
            leading = config.variant.leading_run
            if PoolName.SWA in hits:
                hits[PoolName.SWA] = count_pool_hits(swa, leading_run=leading)
            if PoolName.MAMBA in hits:
                hits[PoolName.MAMBA] = count_pool_hits([not progress.mamba_missing] * keys[PoolName.MAMBA],
                                                       leading_run=leading)
        else:
            in_flight = tuple(i for i, ok in enumerate(swa) if ok)
    return IOResult(completed=completed, reached_sidecars=reached, keys=keys, hits=hits, in_flight=in_flight,
                    finished=finished)


def page_transfer(state: PrefetchState) -> PrefetchState:
    """Every rank's IO thread against the synced hit (:func:`rank_page_transfer`); no collective.

    0.5.23's IO thread re-aligns the SWA keys to its (truncated) hash range before the sidecar fetch and, when they
    are fewer than the window buffer (a rank that staged fewer pages than the hit: F6), shrinks the buffer to them and
    releases its tail at once (``_sync_trailing_keys``, HCC:1809): the rank's ``window`` becomes its keys.
    """
    op = "page_transfer"
    _phase(state, op, Phase.QUERIED)
    ranks = []
    for r in state.ranks:
        io = rank_page_transfer(state.config, r)
        keys = io.keys.get(PoolName.SWA)
        shrink = state.config.variant.protocol_0523 and io.reached_sidecars and keys is not None and keys < (r.window
                                                                                                             or 0)
        ranks.append(r.model_copy(update={"io": io, **({"window": keys} if shrink else {})}))
    return state.model_copy(update={"ranks": tuple(ranks), "phase": Phase.TRANSFERRED})


# ---------------------------------------------------------------- 3. the termination vote


def _can_terminate(config: TPPrefetchConfig, rank: RankState, synced_hit: int, io: IOResult) -> bool:
    """The rank's own ``can`` before the vote (§6.3 step 2; 0.5.23: best_effort only)."""
    policy = rank.progress.policy
    if policy is TerminationPolicy.BEST_EFFORT:
        return True
    if config.variant.protocol_0523:
        return False  # wait_complete waits for the ACK drain; timeout's deadline goes into the vote
    completed = synced_hit > 0 and io.completed == synced_hit
    can = completed if policy is TerminationPolicy.WAIT_COMPLETE else completed or rank.progress.deadline_passed
    if completed and not io.finished and rank.progress.transfers:  # component transfers not done yet
        can = False
    return can


def pack_terminate_vote(config: TPPrefetchConfig, rank: RankState) -> Packed | None:
    """The rank's ``can_terminate_prefetch`` vector (``None``: its policy calls no collective)."""
    io, hit = _io(rank, "can_terminate_prefetch"), _synced(rank, "can_terminate_prefetch")
    if not rank.progress.registered:
        return None
    policy = rank.progress.policy
    if config.variant.protocol_0523:
        if policy is not TerminationPolicy.TIMEOUT:
            return None
        return Packed(op=ReduceOp.MAX, values=(int(rank.progress.deadline_passed),), layout=("deadline",))
    if policy is TerminationPolicy.BEST_EFFORT:
        return None
    can = _can_terminate(config, rank, hit, io)
    terminated = io.finished and (io.completed < hit or hit == 0)  # the IO thread stopped early
    return Packed(op=ReduceOp.MAX, values=(1 - int(can), int(terminated)), layout=("not_can", "terminated"))


def rank_proceeds(config: TPPrefetchConfig, rank: RankState, result: Sequence[int] | None,
                  all_finished: bool) -> bool:
    """Whether the rank terminates the prefetch now: ``best_effort`` at once; #27264 era: every rank can or some
    rank's IO terminated (the MAX of ``[not_can, terminated]``); 0.5.23: ``timeout`` if some deadline passed, or
    every rank's IO finished (the final ACK drained: the result is handled)."""
    if not rank.progress.registered:
        return False
    io = _io(rank, "can_terminate_prefetch")
    can = _can_terminate(config, rank, _synced(rank, "can_terminate_prefetch"), io)
    if config.variant.protocol_0523:
        voted = result is not None and result[0] == 1
        return can or voted or all_finished
    if result is None:  # best_effort: no vote
        return can
    return result[0] == 0 or result[1] == 1


def can_terminate_prefetch(state: PrefetchState) -> PrefetchState:
    """The termination vote; ``WAITING`` when no rank proceeds (the check returns False on every rank)."""
    op = "can_terminate_prefetch"
    _phase(state, op, Phase.TRANSFERRED)
    call = all_reduce(op, [pack_terminate_vote(state.config, r) for r in state.ranks])
    if isinstance(call, CollectiveMismatch):
        return state.model_copy(update={"phase": Phase.MISMATCHED, "mismatch": call})
    all_finished = all(_io(r, op).finished for r in state.ranks)
    result = None if call is None else call.result
    ranks = tuple(r.model_copy(update={"proceeds": rank_proceeds(state.config, r, result if (
        call is not None and call.packed[i] is not None) else None, all_finished)}) for i, r in enumerate(state.ranks))
    collectives = state.collectives if call is None else (*state.collectives, call)
    phase = Phase.DECIDED if any(r.proceeds for r in ranks) else Phase.WAITING
    return state.model_copy(update={"ranks": ranks, "phase": phase, "collectives": collectives})


# ---------------------------------------------------------------- 4. the packed MIN


def pack_prefetch_ack(config: TPPrefetchConfig, rank: RankState) -> tuple[Packed | None, Packed | None]:
    """The rank's ``reduce_prefetch_ack`` vectors: ``(completed, pool hits)``.

    #27264 era (on a rank that proceeds): one vector, ``[completed]`` (``pre_27264``) or ``[completed, hits of each
    transfer pool in component order]``; the second is ``None``. 0.5.23 (every registered rank): ``[completed]``,
    and on a rank with sidecar transfers whose IO thread finished, ``[hits for pool in PoolName]`` (0 in the slot of
    a pool it did not fetch, KV's included); :func:`reduce_prefetch_ack` reduces that one only once every rank's IO
    thread finished.
    """
    io = _io(rank, "reduce_prefetch_ack")
    p = rank.progress
    if not config.variant.protocol_0523:
        if not rank.proceeds:
            return None, None
        if config.variant is TPPrefetchVariant.PRE_27264:
            return Packed(op=ReduceOp.MIN, values=(io.completed,), layout=("completed",)), None
        values = (io.completed, *(io.hits[pool] for pool in p.transfers))
        return Packed(op=ReduceOp.MIN, values=values, layout=("completed", *(pool.value for pool in p.transfers))), \
            None
    if not p.registered:
        return None, None
    completed = Packed(op=ReduceOp.MIN, values=(io.completed,), layout=("completed",))
    if not p.transfers or not io.finished:
        return completed, None
    return completed, Packed(op=ReduceOp.MIN, values=tuple(io.hits.get(pool, 0) for pool in POOL_ORDER),
                             layout=tuple(pool.value for pool in POOL_ORDER))


def unpack_prefetch_ack(config: TPPrefetchConfig, rank: RankState, completed: Sequence[int] | None,
                        hits: Sequence[int] | None) -> tuple[int, dict[PoolName, int], bool]:
    """``(min_completed, the sidecar counts the commit reads, pool_transfers_done)`` from the reduced vectors.

    #27264 era: ``hit_pages[p] = packed[i]`` in place, by the rank's own layout (``pre_27264``: its local counts);
    0.5.23: the pool ACK's MIN by ``PoolName`` once applied (``pool_transfers_done``), else 0.
    """
    io = _io(rank, "reduce_prefetch_ack")
    min_completed = io.completed if completed is None else int(completed[0])
    if not config.variant.protocol_0523:
        if config.variant is TPPrefetchVariant.PRE_27264 or completed is None:
            return min_completed, dict(io.hits), io.finished
        return min_completed, {pool: int(completed[1 + i]) for i, pool in enumerate(rank.progress.transfers)}, \
            io.finished
    if hits is None:
        return min_completed, dict.fromkeys(rank.progress.transfers, 0), False
    by_pool = dict(zip(POOL_ORDER, hits, strict=True))
    return min_completed, {pool: int(by_pool[pool]) for pool in rank.progress.transfers}, True


def reduce_prefetch_ack(state: PrefetchState) -> PrefetchState:
    """The packed MIN of ``[completed, hit pages per sidecar pool...]`` (module docstring: layouts per variant)."""
    op = "reduce_prefetch_ack"
    _phase(state, op, Phase.DECIDED)
    c = state.config
    if c.variant.protocol_0523 and not all(_io(r, op).finished for r in state.ranks):
        # 0.5.23: an IO thread still in flight has emitted no ACK (one per finished batch), and the ACK drain is
        # rank-min: nothing is reduced at this check, the scheduler sees 0 pages completed and no pool result
        none = tuple(r.model_copy(update={"min_completed": 0, "synced_hits": dict.fromkeys(r.progress.transfers, 0),
                                          "transfers_done": False}) for r in state.ranks)
        return state.model_copy(update={"ranks": none, "phase": Phase.REDUCED})
    packs = [pack_prefetch_ack(c, r) for r in state.ranks]
    first = all_reduce(op, [p[0] for p in packs])
    if isinstance(first, CollectiveMismatch):
        return state.model_copy(update={"phase": Phase.MISMATCHED, "mismatch": first})
    calls = [] if first is None else [first]
    second: CollectiveCall | CollectiveMismatch | None = None
    if c.variant.protocol_0523:
        with_transfers = [r for r in state.ranks if r.progress.registered and r.progress.transfers]
        if with_transfers and len(with_transfers) != len(state.ranks):  # a rank never emits the pool ACK
            mismatch = CollectiveMismatch(name=op, packed=tuple(
                Packed(op=ReduceOp.MIN, values=(0,) * len(POOL_ORDER), layout=tuple(p.value for p in POOL_ORDER))
                if r.progress.registered and r.progress.transfers else None for r in state.ranks))
            return state.model_copy(update={"phase": Phase.MISMATCHED, "mismatch": mismatch})
        if with_transfers and all(_io(r, op).finished for r in state.ranks):  # every pool ACK emitted: reduced
            second = all_reduce(op, [p[1] for p in packs])
            if isinstance(second, CollectiveMismatch):
                return state.model_copy(update={"phase": Phase.MISMATCHED, "mismatch": second})
            calls += [] if second is None else [second]
    reduced = second if isinstance(second, CollectiveCall) else None
    ranks = []
    for i, r in enumerate(state.ranks):
        m, hits, tdone = unpack_prefetch_ack(
            c, r, first.result if first is not None and first.packed[i] is not None else None,
            reduced.result if reduced is not None and reduced.packed[i] is not None else None)
        ranks.append(r.model_copy(update={"min_completed": m, "synced_hits": hits, "transfers_done": tdone}))
    return state.model_copy(update={"ranks": tuple(ranks), "phase": Phase.REDUCED,
                                    "collectives": (*state.collectives, *calls)})


# ---------------------------------------------------------------- 5. the host tree


def _nodes_of(config: TPPrefetchConfig) -> tuple[TreeNode, ...]:
    return tuple(TreeNode(length=n.length, swa_host=n.swa_host) for n in config.existing)


def _split(node: TreeNode, at: int) -> tuple[TreeNode, TreeNode]:
    """``_split_node``: the first ``at`` tokens become the parent, the rest stays the child; both keep the flags."""
    return node.model_copy(update={"length": at}), node.model_copy(update={"length": node.length - at})


def insert_host(config: TPPrefetchConfig, nodes: Sequence[TreeNode], total_len: int) -> InsertResult:
    """``_insert_helper_host(anchor, key[:total_len])`` (§6.3 step 6): walk the nodes along the key, split the one
    that ``total_len`` ends inside, and add one node (Full inserted, an SWA tombstone) for the part not present."""
    require(total_len >= 0 and total_len % config.page_size == 0, "insert_host", "total_len",
            f"{total_len} is not a whole number of pages of {config.page_size}")
    out: list[TreeNode] = []
    pos, split, target = 0, None, None
    for node in nodes:
        end = pos + node.length
        if pos < total_len < end:
            upper, lower = _split(node, total_len - pos)
            out += [upper, lower]
            split, target = total_len, len(out) - 2
        else:
            out.append(node)
            if end == total_len:
                target = len(out) - 1
        pos = end
    prefix = min(pos, total_len)
    if total_len > pos:
        out.append(TreeNode(length=total_len - pos, inserted=True))
        target = len(out) - 1
    return InsertResult(nodes=tuple(out), prefix_len=prefix, total_len=total_len,
                        target=target if total_len > 0 else None, split=split)


def commit_prefetch(config: TPPrefetchConfig, inserted: InsertResult, window: int, loaded: int, *,
                    holds_from: int | None = None, check_mid_tree: bool = False) -> SwaCommit:
    """The SWA component's ``_commit_prefetch`` (§6.4) on one rank: all-or-nothing over its ``window``-page buffer.

    ``loaded`` is the SWA count it reads (the cross-rank MIN after the sync). Nothing inserted, no buffer or
    ``loaded < window``: release the whole buffer. Else the buffer covers ``[total - window, total)`` pages; walk
    from the target node up to the anchor: a tombstone overlapping the buffer gets its slice (split so that the
    in-window suffix is its own node), a node that has SWA releases its slice; a prefix before the anchor is
    released. ``holds_from``: the token position whose SWA the buffer's first page holds (recorded on attached
    nodes). ``check_mid_tree`` (0.5.23): a sub-window mid-tree is dropped.
    """
    p = config.page_size
    released = (SlotOwner.FREED,) * window
    nodes = inserted.nodes
    if window == 0:
        return SwaCommit(nodes=nodes, swa_slots=(), attached=False, split=None)
    if check_mid_tree and not config.anchor_is_root and window < config.sw_pages:
        return SwaCommit(nodes=nodes, swa_slots=released, attached=False, split=None)
    if inserted.target is None or loaded < window:
        return SwaCommit(nodes=nodes, swa_slots=released, attached=False, split=None)
    owners = [SlotOwner.FREED] * window
    total = inserted.total_len // p
    start = total - window  # pages, relative to the anchor (negative: the window reaches before the anchor)
    path = list(nodes)
    idx, pos, split = inserted.target, total, None
    while idx >= 0 and pos > start:
        node = path[idx]
        node_start = pos - node.length // p
        fill_start = max(node_start, start)
        fill = pos - fill_start
        if not node.swa_host and fill > 0:
            if fill_start > node_start:  # the in-window suffix becomes its own node
                upper, lower = _split(node, (fill_start - node_start) * p)
                path[idx:idx + 1] = [upper, lower]
                idx += 1
                split = fill_start * p
            pages = tuple(range(fill_start - start, pos - start))
            source = None if holds_from is None else holds_from + (fill_start - start) * p
            path[idx] = path[idx].model_copy(update={"swa_host": True, "swa_pages": pages, "swa_from": source})
            for page in pages:
                owners[page] = SlotOwner.TREE
        pos, idx = node_start, idx - 1
    return SwaCommit(nodes=tuple(path), swa_slots=tuple(owners), attached=True, split=split)


def rank_handle_prefetch_result(config: TPPrefetchConfig, rank: RankState) -> RankCommit:
    """One proceeding rank's ``handle_prefetch_result``: 0.5.23's all-or-nothing check, the insert, the SWA commit,
    and every host slot's owner (T4; module docstring)."""
    op = "handle_prefetch_result"
    io = _io(rank, op)
    require(rank.min_completed is not None and rank.synced_hits is not None, op, "state",
            "reduce_prefetch_ack first")
    m = int(rank.min_completed or 0)
    counts = rank.synced_hits or {}
    p, staged, target = config.page_size, _staged(rank, op), rank_target(rank, op)
    n = _window(rank, op)
    v = config.variant
    keys_swa = io.keys.get(PoolName.SWA, 0)
    holds_from = (target - keys_swa) * p  # the SWA window the IO thread fetched ends at its target (T3)
    if v.protocol_0523:
        # _check_hybrid_prefetch_result: the rank's own expected length is its (truncated) hash_value
        ok = m == target and all(counts.get(pool, 0) == io.keys[pool] for pool in rank.progress.transfers)
        if rank.progress.transfers and not ok:  # discard the whole prefetch
            full = (SlotOwner.RELEASE_QUEUE,) * m + (SlotOwner.IO_THREAD,) * (staged - m)
            scheduler = rank.transfers_done or v is TPPrefetchVariant.BEST_EFFORT_RELEASE
            swa = ((SlotOwner.RELEASE_QUEUE if scheduler else SlotOwner.IO_THREAD),) * n
            hazard = tuple(i for i in io.in_flight if swa[i] is not SlotOwner.IO_THREAD)
            return RankCommit(nodes=_nodes_of(config), prefix_len=0, total_len=0, attached=False, discarded=True,
                              insert_split=None, swa_split=None, full_slots=full, swa_slots=swa,
                              written_after_release=hazard)
    inserted = insert_host(config, _nodes_of(config), m * p)
    swa_commit = commit_prefetch(config, inserted, n, counts.get(PoolName.SWA, 0), holds_from=holds_from,
                                 check_mid_tree=v.protocol_0523)
    prefix = inserted.prefix_len // p
    completed = io.completed if not v.protocol_0523 else m  # 0.5.23: the IO thread releases the rank-local tail
    full = ((SlotOwner.FREED,) * prefix + (SlotOwner.TREE,) * (m - prefix)
            + (SlotOwner.RELEASE_QUEUE,) * (completed - m) + (SlotOwner.IO_THREAD,) * (staged - completed))
    hazard = tuple(i for i in io.in_flight if swa_commit.swa_slots[i] is not SlotOwner.IO_THREAD)
    return RankCommit(nodes=swa_commit.nodes, prefix_len=inserted.prefix_len, total_len=m * p,
                      attached=swa_commit.attached, discarded=False, insert_split=inserted.split,
                      swa_split=swa_commit.split, full_slots=full,
                      swa_slots=swa_commit.swa_slots, written_after_release=hazard)


def _waiting_commit(config: TPPrefetchConfig, rank: RankState) -> RankCommit:
    """A rank that does not terminate yet: its tree unchanged, its slots still held by the prefetch (a rank that never
    registered holds none)."""
    full, swa = _staged(rank, "handle_prefetch_result"), _window(rank, "handle_prefetch_result")
    return RankCommit(nodes=_nodes_of(config), prefix_len=0, total_len=0, attached=False, discarded=False,
                      insert_split=None, swa_split=None, full_slots=(SlotOwner.HELD,) * full,
                      swa_slots=(SlotOwner.HELD,) * swa, written_after_release=())


def handle_prefetch_result(state: PrefetchState) -> PrefetchState:
    """Every proceeding rank inserts, commits and releases (:func:`rank_handle_prefetch_result`); a rank that still
    waits keeps its tree and its slots (``HELD``). No collective."""
    op = "handle_prefetch_result"
    _phase(state, op, Phase.REDUCED)
    ranks = tuple(r.model_copy(update={"commit": rank_handle_prefetch_result(state.config, r) if r.proceeds
                                       else _waiting_commit(state.config, r)}) for r in state.ranks)
    return state.model_copy(update={"ranks": ranks, "phase": Phase.COMMITTED})


def check_prefetch_progress(config: TPPrefetchConfig, ranks: Sequence[RankProgress]) -> PrefetchState:
    """One check of the prefetch on every rank: the five operations in order, until a mismatch, a wait or (0.5.23) a
    revoke."""
    state = initial_state(config, ranks)
    for step in (sync_prefetch_hit_query, page_transfer, can_terminate_prefetch, reduce_prefetch_ack,
                 handle_prefetch_result):
        state = step(state)
        if state.phase in (Phase.MISMATCHED, Phase.WAITING, Phase.REVOKED):
            break
    return state


# ---------------------------------------------------------------- a group over many prefetches (runtime, suite)


class TPPrefetchGroup(ConfigModel):
    """A tensor-parallel group and its host side, over many prefetches: what a multi-process runtime is built from.

    Every rank starts with the host path ``existing`` below the anchor (each node's Full host value, and its SWA
    host value where ``swa_host``: one host page per node page in each pool). A prefetch of ``R`` pages
    (``R * P`` tokens at least as long as the path, at most ``max_request_pages``) runs on the current path
    (:meth:`check_config`); its commit becomes the next path (:func:`path_after`). The host pools are sized so that
    a path of ``max_request_pages`` pages and one prefetch's buffers always fit (no host out-of-memory here).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str = "group"
    world_size: int = Field(ge=1, le=MAX_WORLD_SIZE, description="N: tensor-parallel ranks")
    page_size: int = Field(ge=1)
    sliding_window: int = Field(ge=1)
    anchor_is_root: bool = False
    existing: tuple[HostNode, ...] = ()
    max_request_pages: int = Field(ge=1, le=64)
    variant: TPPrefetchVariant = TPPrefetchVariant.UPSTREAM_0523

    @model_validator(mode="after")
    def _fits(self) -> TPPrefetchGroup:
        self.check_config(max(self.max_request_pages, self.path_pages(self.existing)), self.existing)
        if self.path_pages(self.existing) > self.max_request_pages:
            raise ConfigError("TPPrefetchGroup", "existing", f"the path has {self.path_pages(self.existing)} pages, "
                              f"more than max_request_pages {self.max_request_pages}")
        return self

    def label(self) -> str:
        """Short id for test ids and reports, e.g. ``w2-N2-P2-W4-R8`` (the variant is a run option)."""
        return f"{self.name}-N{self.world_size}-P{self.page_size}-W{self.sliding_window}-R{self.max_request_pages}"

    @property
    def sw_pages(self) -> int:
        return ceil_div(self.sliding_window, self.page_size)

    @property
    def host_pages(self) -> int:
        """Full host pool pages per rank: a full path plus one prefetch's buffer."""
        return 2 * self.max_request_pages

    @property
    def swa_host_pages(self) -> int:
        """SWA host pool pages per rank: a full path of SWA values plus one window buffer."""
        return self.max_request_pages + max(self.sw_pages, self.max_request_pages)

    def path_pages(self, path: Sequence[HostNode]) -> int:
        return sum(n.length for n in path) // self.page_size

    def check_config(self, request_pages: int, path: Sequence[HostNode]) -> TPPrefetchConfig:
        """The one-prefetch config of a request of ``request_pages`` pages on ``path``."""
        return TPPrefetchConfig(page_size=self.page_size, sliding_window=self.sliding_window,
                                request_pages=request_pages, anchor_is_root=self.anchor_is_root,
                                existing=tuple(path), variant=self.variant)

    def with_variant(self, variant: TPPrefetchVariant | str) -> TPPrefetchGroup:
        return self.model_copy(update={"variant": TPPrefetchVariant(variant)})


def path_after(commit: RankCommit) -> tuple[HostNode, ...]:
    """The host path a rank holds after ``commit`` (what the next prefetch starts from)."""
    return tuple(HostNode(length=n.length, swa_host=n.swa_host) for n in commit.nodes)


class RankSnapshot(BaseModel):
    """One rank's host side between operations: its path below the anchor and its two host pools' slots.

    ``*_held``: slots of a prefetch that has not committed yet (its buffers); after every check the release queue
    and the IO thread's releases are drained (upstream: at the scheduler's next step and the IO thread's end).
    """

    model_config = _FROZEN

    nodes: tuple[HostNode, ...]
    full_capacity: int
    full_free: int
    full_in_tree: int
    full_held: int
    swa_capacity: int
    swa_free: int
    swa_in_tree: int
    swa_held: int

    def conservation_problem(self, page_size: int) -> str | None:
        """What breaks slot conservation (every slot free, in the tree or held, once), or ``None``."""
        pages = sum(n.length for n in self.nodes) // page_size
        swa = sum(n.length for n in self.nodes if n.swa_host) // page_size
        if self.full_in_tree != pages:
            return f"the path's nodes span {pages} pages but the tree holds {self.full_in_tree} Full host slots"
        if self.swa_in_tree != swa:
            return f"the path's SWA host values span {swa} pages but the tree holds {self.swa_in_tree} SWA host slots"
        for pool in ("full", "swa"):
            cap, free, tree, held = (getattr(self, f"{pool}_{k}") for k in ("capacity", "free", "in_tree", "held"))
            if free + tree + held != cap:
                return (f"{pool} host pool: {free} free + {tree} in the tree + {held} held != capacity {cap} "
                        f"(a slot lost or counted twice)")
        return None


class TPPrefetchSnapshot(BaseModel):
    """Every rank's :class:`RankSnapshot`, in rank order."""

    model_config = _FROZEN

    ranks: tuple[RankSnapshot, ...]


class PhaseReport(BaseModel):
    """What one system operation did on every rank: the phase it reached, the collectives it made, a mismatched
    collective (naming the ranks and the shapes), each rank's decision (``can_terminate_prefetch``) and commit
    (``handle_prefetch_result``). ``seconds`` and ``detail`` (how a runtime saw a failure) are not compared."""

    model_config = _FROZEN

    op: str
    phase: Phase
    collectives: tuple[CollectiveCall, ...] = ()
    mismatch: CollectiveMismatch | None = None
    proceeds: tuple[bool | None, ...] = ()
    commits: tuple[RankCommit, ...] = ()
    seconds: float = 0.0
    detail: str = ""

    def compared(self) -> tuple[object, ...]:
        """The fields two sides must agree on (a mismatch: its groups of ranks and their shapes)."""
        return (self.op, self.phase, self.collectives, None if self.mismatch is None else self.mismatch.groups(),
                self.proceeds, self.commits)


def phase_report(op: str, before: PrefetchState, after: PrefetchState) -> PhaseReport:
    """The reference's :class:`PhaseReport` of ``op`` from the states before and after it."""
    decided = op == "can_terminate_prefetch" and after.phase is not Phase.MISMATCHED  # a mismatched vote decides none
    proceeds = tuple(r.proceeds for r in after.ranks) if decided else ()
    commits = tuple(r.commit for r in after.ranks if r.commit is not None) if op == "handle_prefetch_result" else ()
    return PhaseReport(op=op, phase=after.phase, collectives=after.collectives[len(before.collectives):],
                       mismatch=after.mismatch, proceeds=proceeds, commits=commits)


# ---------------------------------------------------------------- invariants


def tree_shape(commit: RankCommit) -> tuple[tuple[int, bool, bool], ...]:
    """A rank's host path as T1 compares it: each node's length, SWA host value and whether it was inserted now
    (slot ids and the data they hold are rank-local)."""
    return tuple((n.length, n.swa_host, n.inserted) for n in commit.nodes)


def check_rank_commit(config: TPPrefetchConfig, commit: RankCommit) -> None:
    """One rank's commit is consistent (T4): the nodes cover whole pages, the Full pages in the tree are the ones
    inserted, every attached window page is on exactly one node, no released page is still written."""
    p = config.page_size
    ensure(all(n.length > 0 and n.length % p == 0 for n in commit.nodes), "T4",
           f"a node is not a positive whole number of pages: {[n.length for n in commit.nodes]}")
    inserted = sum(n.length for n in commit.nodes if n.inserted) // p
    in_tree = commit.full_slots.count(SlotOwner.TREE)
    ensure(in_tree == inserted, "T4", f"{in_tree} Full host pages owned by the tree, {inserted} pages inserted")
    ensure(len(commit.full_slots) <= config.request_pages, "T4",
           f"{len(commit.full_slots)} Full host pages tracked for a {config.request_pages}-page request")
    attached = [page for n in commit.nodes for page in n.swa_pages]
    ensure(len(attached) == len(set(attached)), "T4", f"a window page is attached twice: {attached}")
    on_tree = [i for i, o in enumerate(commit.swa_slots) if o is SlotOwner.TREE]
    ensure(sorted(attached) == on_tree, "T4", f"window pages attached to nodes {sorted(attached)}, owned by the "
                                              f"tree {on_tree}")
    for n in commit.nodes:
        ensure(len(n.swa_pages) * p in (0, n.length), "T4", f"a {n.length}-token node holds {len(n.swa_pages)} "
                                                            f"window page(s)")
    ensure(not commit.written_after_release, "T4",
           f"window-buffer pages {list(commit.written_after_release)} released by the scheduler while the IO thread "
           "still writes them (R5-d: a slot released, then written)")


def check_tp_prefetch(state: PrefetchState) -> None:
    """T1-T5 (§6.5) on a finished check; raises :class:`InvariantViolation` for the first broken one (a mismatched
    or mixed collective: T5; ranks that committed different trees, or some committed while others wait: T1; a window
    attached that some rank did not fetch whole: T2; attached at positions whose KV it does not hold: T3; a rank's
    slots, or a page released while written: T4)."""
    if state.mismatch is not None:
        ensure(False, "T5", state.mismatch.describe())
    for call in state.collectives:
        if call.mixed:
            layouts = "; ".join(f"rank {i}: [{', '.join(p.layout)}]" for i, p in enumerate(call.packed) if p)
            ensure(False, "T5", f"{call.name}: same shape, different slots reduced together: {layouts}")
    if state.phase is not Phase.COMMITTED:
        return
    c = state.config
    commits = [r.commit for r in state.ranks]
    for i, commit in enumerate(commits):
        ensure(commit is not None, "T4", f"rank {i} has no result")
    done = [(i, r.commit) for i, r in enumerate(state.ranks) if r.proceeds and r.commit is not None]
    waiting = [i for i, r in enumerate(state.ranks) if not r.proceeds and r.progress.registered]
    ensure(not waiting, "T1", f"ranks {[i for i, _ in done]} committed the prefetch while ranks {waiting} still wait: "
                              "their host trees differ until those commit")
    shapes = {i: tree_shape(commit) for i, commit in done}
    first = next(iter(shapes.values()), ())
    for i, shape in shapes.items():
        ensure(shape == first, "T1", f"rank {done[0][0]}'s host path {first} differs from rank {i}'s {shape} "
                                     "(length, SWA host value, inserted now)")
    for i, commit in done:
        check_rank_commit(c, commit)
        if not commit.attached:
            continue
        for j, r in enumerate(state.ranks):
            io = r.io
            n = r.window or 0
            whole = io is not None and io.reached_sidecars and io.keys.get(PoolName.SWA, 0) == n and not [
                k for k in r.progress.swa_missing if k < n] and r.progress.io_done
            ensure(whole, "T2", f"rank {i} attached its SWA window but rank {j} did not fetch all {n} window pages "
                                f"(completed {io.completed if io else '-'} of hit {r.synced_hit}, missing "
                                f"{list(r.progress.swa_missing)})")
        for n_ in commit.nodes:
            if n_.swa_pages:
                at = _node_start(commit, n_)
                ensure(n_.swa_from == at, "T3", f"rank {i}: tokens {at}-{at + n_.length - 1} got the SWA KV of "
                                                f"tokens {n_.swa_from}-{(n_.swa_from or 0) + n_.length - 1}")


def _node_start(commit: RankCommit, node: TreeNode) -> int:
    pos = 0
    for n in commit.nodes:
        if n is node:
            return pos
        pos += n.length
    return pos


def check_hit_counts(state: PrefetchState) -> None:
    """R5-c: the SWA count a rank's commit reads, ``c``, means the first ``c`` window pages arrived on every rank it
    was reduced over (its own only under ``pre_27264``). Counting by sum (#27264, ``sum_hits``) breaks it when a page
    in the middle fails; harmless for SWA's all-or-nothing commit (:func:`check_tp_prefetch` holds), wrong for any
    prefix reading. Raises :class:`InvariantViolation`."""
    for i, r in enumerate(state.ranks):
        counts = r.synced_hits or {}
        c = counts.get(PoolName.SWA, 0)
        if PoolName.SWA not in counts or not r.proceeds:
            continue
        over = [i] if state.config.variant is TPPrefetchVariant.PRE_27264 else range(len(state.ranks))
        for j in over:
            other = state.ranks[j]
            lost = [k for k in other.progress.swa_missing if k < c]
            ensure(not lost, "R5-c", f"rank {i} reads {c} SWA pages as fetched, but rank {j} misses window page(s) "
                                     f"{lost} (hits counted by sum, not leading run)")


# ---------------------------------------------------------------- preconditions


def _phase(state: PrefetchState, op: str, want: Phase) -> None:
    require(state.phase is want, op, "state", f"phase is {state.phase.value}, {op} runs at {want.value}")


def _synced(rank: RankState, op: str) -> int:
    require(rank.synced_hit is not None, op, "state", "sync_prefetch_hit_query first")
    return int(rank.synced_hit or 0)


def _staged(rank: RankState, op: str) -> int:
    require(rank.staged is not None, op, "state", "sync_prefetch_hit_query first (0.5.23 stages at hit time)")
    return int(rank.staged or 0)


def _window(rank: RankState, op: str) -> int:
    require(rank.window is not None, op, "state", "sync_prefetch_hit_query first (0.5.23 stages at hit time)")
    return int(rank.window or 0)


def _io(rank: RankState, op: str) -> IOResult:
    if rank.io is None:
        raise InvalidOperation(op, "state", "page_transfer first")
    return rank.io

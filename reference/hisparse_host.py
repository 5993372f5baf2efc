"""``hisparse_host``: the HiSparse paged host pool and its request table as pure operations.

Models PR #23606 as in SGLang 0.5.13-0.5.23 (sglang_semantics.md §4): the host pool
(``HostKVCache`` with ``page_size`` P_h, a token-granular FIFO ``free_slots``, §4.2),
the coordinator's request table (``req_to_host_pool`` rows of width
``max_context_len + P_h`` initialised to -1, ``req_to_host_pool_allocated_len``,
§4.3), the ``HiSparseHostPoolMixin`` operations (``alloc_page``,
``alloc_paged_token_slots``, ``allocated_host_indices``, §4.4) and the coordinator's
call sites (``admit_request_into_staging``, ``_eager_backup_previous_token`` named
``eager_backup_previous_token``, ``request_finished``, §4.5). Invariants H0-H4 (§4.6)
are checked by :func:`check_host_pool`; scenario S7 (§9) is a test vector.

Host data is one integer per host slot (the harness writes a unique value per
request position; the torch runtime stores it in a CPU buffer). A request slot
``r`` indexes the table like ``req_pool_idx``; slots are reused after release.

The coordinator version is one typed parameter, :class:`Coordinator`:

* ``PAGED`` (#23606): host slots are handed out in whole pages per request;
* ``PRE_23606``: the pre-change coordinator, which called the pool's token-granular
  ``alloc(n)`` for a staging of ``n`` tokens and ``alloc(#reqs)`` for a backup batch.
  With ``P_h > 1`` that breaks the page rule ``alloc`` asserts (``n % P_h == 0``,
  §4.7: 1 000 tokens at P_h = 64); with ``P_h = 1`` under a device page size of 64
  the rows stop being aligned host pages, which the page transfers need (H1 at the
  transfer page size).

[Differs from SGLang 0.5.23:]

* out of host memory raises :class:`OutOfMemory` naming the request and the pages
  asked, and changes nothing (upstream logs and raises ``RuntimeError``, §4.8);
  a backup batch is all-or-nothing (upstream stops at the first short request);
* caller misuse that upstream asserts or leaves unchecked (``start_pos`` past the
  allocated length: the hole precondition H4; a rounded end past the row width;
  staging a request slot that is not empty: H3; a request slot out of range) raises
  :class:`InvalidOperation`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvproof.reference.arith import ceil_p
from kvproof.reference.config import ConfigModel
from kvproof.reference.errors import ConfigError, OutOfMemory, ensure, require

__all__ = [
    "Coordinator",
    "HostPoolConfig",
    "HostPoolSnapshot",
    "HostPoolState",
    "admit_request_into_staging",
    "alloc",
    "alloc_page",
    "alloc_paged_token_slots",
    "allocated_host_indices",
    "allocated_len_after",
    "available_size",
    "check_host_pool",
    "check_host_snapshot",
    "eager_backup_previous_token",
    "get_host_data",
    "host_new_pages",
    "host_slot",
    "initial_state",
    "request_finished",
    "row_width",
    "set_host_data",
    "snapshot",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class Coordinator(str, enum.Enum):  # noqa: UP042 - StrEnum would change str() and f-strings (pytest ids, reports) from Class.MEMBER to the value
    """Which coordinator calls the host pool (§4.5, §4.7)."""

    PAGED = "paged"  # PR #23606: whole host pages per request, alloc_paged_token_slots
    PRE_23606 = "pre_23606"  # token-granular alloc(n) for staging and alloc(#reqs) for a backup batch


class HostPoolConfig(ConfigModel):
    """Host pool geometry and the request table's shape."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    page_size: int = Field(ge=1, description="P_h: host page size (#23606: the device page size)")
    num_pages: int = Field(ge=1, description="host pages; the pool holds num_pages * page_size token slots")
    max_req_slots: int = Field(ge=1, description="rows of req_to_host_pool")
    max_context_len: int = Field(ge=1, description="longest request; rows are max_context_len + page_size wide")
    device_page_size: int | None = Field(default=None, ge=1,
                                         description="page size of device/transfer pages (default: page_size)")
    coordinator: Coordinator = Coordinator.PAGED

    @model_validator(mode="after")
    def _transfer_pages(self) -> HostPoolConfig:
        # the host page size divides the transfer page size or equals it (1 | 64 before, 64 == 64 after)
        if self.transfer_page_size % self.page_size:
            raise ConfigError("HostPoolConfig", "device_page_size",
                              f"must be a multiple of page_size ({self.page_size}), got {self.transfer_page_size}")
        # #23606 makes the host page size the device page size
        if self.coordinator is Coordinator.PAGED and self.transfer_page_size != self.page_size:
            raise ConfigError("HostPoolConfig", "device_page_size",
                              f"coordinator 'paged' uses the device page size as host page size: device_page_size "
                              f"{self.transfer_page_size} != page_size {self.page_size}")
        return self

    @property
    def size(self) -> int:
        return self.num_pages * self.page_size

    @property
    def transfer_page_size(self) -> int:
        return self.device_page_size or self.page_size

    @property
    def row_width(self) -> int:
        return row_width(self.max_context_len, self.page_size)

    @classmethod
    def from_requested_size(cls, size: int, page_size: int, **fields: object) -> HostPoolConfig:
        """``HostKVCache``'s sizing: ``page_num = size // P_h + 1`` (§4.2)."""
        return cls.model_validate({"page_size": page_size, "num_pages": size // page_size + 1, **fields})

    def label(self) -> str:
        dev = f"-D{self.device_page_size}" if self.device_page_size not in (None, self.page_size) else ""
        pre = "-pre23606" if self.coordinator is Coordinator.PRE_23606 else ""
        return f"P{self.page_size}{dev}-H{self.num_pages}-R{self.max_req_slots}-C{self.max_context_len}{pre}"


class HostPoolState(BaseModel):
    """Free list, request rows (the valid prefix of each row), host data, and the skip-first-backup flags."""

    model_config = _FROZEN

    config: HostPoolConfig
    free_slots: tuple[int, ...]  # FIFO, token-granular (§4.2)
    rows: tuple[tuple[int, ...], ...]  # rows[r] = req_to_host_pool[r, :allocated_len[r]]; -1 beyond
    data: tuple[int | None, ...]  # host data per host slot (None: never written since allocation)
    skip_first_backup: tuple[bool, ...]


class HostPoolSnapshot(BaseModel):
    """What every implementation reports: free list in hand-out order, allocated lengths, full rows."""

    model_config = _FROZEN

    page_size: int
    size: int
    free_slots: tuple[int, ...]
    allocated_len: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]  # the whole row, -1 where no host slot

    @property
    def available_size(self) -> int:
        return len(self.free_slots)


# ---------------------------------------------------------------- arithmetic (mirrored in kvproof.spec.hisparse_host)


def row_width(max_context_len: int, page_size: int) -> int:
    """Width of a ``req_to_host_pool`` row: ``max_context_len + P_h`` (room to round the last page up, §4.3)."""
    return max_context_len + page_size


def allocated_len_after(allocated_len: int, start_pos: int, num_tokens: int, page_size: int) -> int:
    """``alloc_len[r]`` after ``alloc_paged_token_slots``: ``max(a, ceil_P(start + n))`` (unchanged for ``n <= 0``)."""
    if num_tokens <= 0:
        return allocated_len
    return max(allocated_len, ceil_p(start_pos + num_tokens, page_size))


def host_new_pages(allocated_len: int, start_pos: int, num_tokens: int, page_size: int) -> int:
    """Pages ``alloc_paged_token_slots`` takes: ``(ceil_P(end) - a) / P`` when ``ceil_P(end) > a``, else 0."""
    return (allocated_len_after(allocated_len, start_pos, num_tokens, page_size) - allocated_len) // page_size


def host_slot(pages: Sequence[int], position: int, page_size: int) -> int:
    """Host slot of ``position`` in a row made of host pages ``pages`` (one aligned page per aligned block)."""
    return pages[position // page_size] * page_size + position % page_size


# ---------------------------------------------------------------- construction and queries


def initial_state(config: HostPoolConfig) -> HostPoolState:
    """``free_slots = arange(size)``: slot 0 is not reserved on the host (§4.2)."""
    return HostPoolState(config=config, free_slots=tuple(range(config.size)),
                         rows=((),) * config.max_req_slots, data=(None,) * config.size,
                         skip_first_backup=(False,) * config.max_req_slots)


def available_size(state: HostPoolState) -> int:
    return len(state.free_slots)


def allocated_host_indices(state: HostPoolState, req: int) -> tuple[int, ...]:
    """The valid host slots of request slot ``req`` (-1 entries filtered, §4.4)."""
    _check_req(state, "allocated_host_indices", req)
    return state.rows[req]


def get_host_data(state: HostPoolState, slots: Sequence[int]) -> tuple[int | None, ...]:
    """Host data at ``slots`` (``None``: allocated but never written)."""
    _check_slots(state, "get_host_data", slots)
    return tuple(state.data[s] for s in slots)


def snapshot(state: HostPoolState) -> HostPoolSnapshot:
    w = state.config.row_width
    return HostPoolSnapshot(page_size=state.config.page_size, size=state.config.size, free_slots=state.free_slots,
                            allocated_len=tuple(len(r) for r in state.rows),
                            rows=tuple(r + (-1,) * (w - len(r)) for r in state.rows))


# ---------------------------------------------------------------- pool operations (§4.2, §4.4)


def alloc(state: HostPoolState, need_size: int, *, req: int | None = None) -> tuple[HostPoolState, tuple[int, ...]]:
    """``HostKVCache.alloc(n)``: the first ``n`` free slots; ``n`` must be whole pages (the page rule)."""
    op, p = "alloc", state.config.page_size
    require(need_size >= 0, op, "need_size", f"must be >= 0, got {need_size}")
    # the page rule: the host pool hands out whole pages only
    require(need_size % p == 0, op, "need_size", f"{need_size} is not a multiple of page_size {p} (page rule)")
    if need_size > len(state.free_slots):
        raise OutOfMemory(op, "host", need_size // p, len(state.free_slots) // p, request=req)
    taken = state.free_slots[:need_size]
    data = list(state.data)
    for s in taken:
        data[s] = None  # a new owner reads nothing of the old one
    return state.model_copy(update={"free_slots": state.free_slots[need_size:], "data": tuple(data)}), taken


def alloc_page(state: HostPoolState, k: int, *, req: int | None = None) -> tuple[HostPoolState, tuple[int, ...]]:
    """``alloc_page(k) = alloc(k * P_h)``."""
    require(k >= 0, "alloc_page", "k", f"must be >= 0, got {k}")
    return alloc(state, k * state.config.page_size, req=req)


def alloc_paged_token_slots(state: HostPoolState, req: int, start_pos: int, num_tokens: int
                            ) -> tuple[HostPoolState, tuple[int, ...]]:
    """Token slots ``[start_pos, start_pos + num_tokens)`` of request slot ``req``, extending its row by whole pages.

    New pages only when the rounded end passes the allocated length; the returned
    slots are the row's entries for those positions (§4.4).
    """
    op, p = "alloc_paged_token_slots", state.config.page_size
    _check_req(state, op, req)
    if num_tokens <= 0:  # upstream returns an empty tensor before any other check
        return state, ()
    require(start_pos >= 0, op, "start_pos", f"must be >= 0, got {start_pos}")
    a = len(state.rows[req])
    # no holes: a request's host row is filled left to right (upstream asserts start_pos <= allocated)
    require(start_pos <= a, op, "start_pos", f"{start_pos} > allocated length {a} of request {req} (hole)")
    end = start_pos + num_tokens
    # the rounded end must fit the row (exact precondition: end <= floor_P(row width))
    require(ceil_p(end, p) <= state.config.row_width, op, "num_tokens",
            f"end {end} rounds up to {ceil_p(end, p)} > row width {state.config.row_width}")
    k = host_new_pages(a, start_pos, num_tokens, p)
    if k:
        state, new = alloc_page(state, k, req=req)
        rows = list(state.rows)
        rows[req] = rows[req] + new
        state = state.model_copy(update={"rows": tuple(rows)})
    return state, state.rows[req][start_pos:end]


def request_finished(state: HostPoolState, req: int) -> HostPoolState:
    """Release request slot ``req``: its host slots back to the pool, row -1, length 0, skip flag cleared (§4.5)."""
    _check_req(state, "request_finished", req)
    rows, skip = list(state.rows), list(state.skip_first_backup)
    released = rows[req]
    rows[req], skip[req] = (), False
    return state.model_copy(update={"free_slots": state.free_slots + released, "rows": tuple(rows),
                                    "skip_first_backup": tuple(skip)})


def set_host_data(state: HostPoolState, slots: Sequence[int], values: Sequence[int]) -> HostPoolState:
    """The device-to-host copy: ``values[i]`` lands in host slot ``slots[i]`` (an allocated one)."""
    op = "set_host_data"
    require(len(slots) == len(values), op, "values", f"{len(values)} values for {len(slots)} slots")
    _check_slots(state, op, slots)
    data = list(state.data)
    for s, v in zip(slots, values, strict=True):
        data[s] = v
    return state.model_copy(update={"data": tuple(data)})


# ---------------------------------------------------------------- coordinator call sites (§4.5)


def admit_request_into_staging(state: HostPoolState, req: int, values: Sequence[int]
                               ) -> tuple[HostPoolState, tuple[int, ...]]:
    """Back up a prefill of ``len(values)`` tokens into request slot ``req`` (an empty one).

    ``PAGED``: ``alloc_paged_token_slots(req, 0, n)``; ``PRE_23606``: ``alloc(n)``
    and an explicit row write. Then the copy of the values; the first backup after
    admission is skipped (``_skip_first_backup``).
    """
    op, n = "admit_request_into_staging", len(values)
    _check_req(state, op, req)
    require(n >= 1, op, "values", "a prefill has at least one token")
    # H3: staging starts from an empty row
    require(not state.rows[req], op, "req", f"request slot {req} still holds {len(state.rows[req])} host slots")
    require(n <= state.config.max_context_len, op, "values",
            f"{n} tokens > max_context_len {state.config.max_context_len}")
    if state.config.coordinator is Coordinator.PAGED:
        state, slots = alloc_paged_token_slots(state, req, 0, n)
    else:
        state, slots = alloc(state, n, req=req)
        state = _set_row(state, req, slots)
    state = set_host_data(state, slots, values)
    skip = list(state.skip_first_backup)
    skip[req] = True
    return state.model_copy(update={"skip_first_backup": tuple(skip)}), slots


def eager_backup_previous_token(state: HostPoolState, reqs: Sequence[int], seq_lens: Sequence[int],
                                values: Sequence[int]) -> tuple[HostPoolState, tuple[int, ...]]:
    """Back up the previous token (position ``seq_len - 2``) of each running request; compress ratio 1.

    A request admitted since the last backup is skipped once (its flag is cleared).
    ``PAGED``: one ``alloc_paged_token_slots(r, seq_len - 2, 1)`` per kept entry, all
    or nothing; ``PRE_23606``: one ``alloc`` for the kept entries whose position extends
    their row, and a scatter into the rows (a position backed up twice reuses its slot;
    upstream allocated a new one and leaked the old, which this model does not keep).
    Returns the host slots written, in batch order (skipped entries excluded).
    """
    op = "eager_backup_previous_token"
    require(len(reqs) == len(seq_lens) == len(values), op, "seq_lens",
            f"{len(reqs)} requests, {len(seq_lens)} seq_lens, {len(values)} values")
    require(len(set(reqs)) == len(reqs), op, "reqs", f"duplicate request slots in {list(reqs)}")
    for r, s in zip(reqs, seq_lens, strict=True):
        _check_req(state, op, r)
        # the request is staged and its previous token exists
        require(bool(state.rows[r]) and s >= 2, op, "seq_lens", f"request slot {r} with seq_len {s} has no "
                f"previous token to back up (allocated length {len(state.rows[r])})")
    skip = list(state.skip_first_backup)
    kept = [(r, s - 2, v) for r, s, v in zip(reqs, seq_lens, values, strict=True) if not skip[r]]
    for r in reqs:
        skip[r] = False
    if state.config.coordinator is Coordinator.PRE_23606:
        new, written = _backup_token_granular(state, kept)
    else:
        new, written = _backup_paged(state, op, kept)
    return new.model_copy(update={"skip_first_backup": tuple(skip)}), written


def _backup_paged(state: HostPoolState, op: str, kept: list[tuple[int, int, int]]
                  ) -> tuple[HostPoolState, tuple[int, ...]]:
    p = state.config.page_size
    for r, pos, _ in kept:
        # H4: the backed-up position is at most the allocated length (no hole)
        require(pos <= len(state.rows[r]), op, "seq_lens",
                f"position {pos} of request slot {r} > allocated length {len(state.rows[r])} (hole)")
        require(ceil_p(pos + 1, p) <= state.config.row_width, op, "seq_lens",
                f"position {pos} of request slot {r} rounds past row width {state.config.row_width}")
    wanted = [(r, host_new_pages(len(state.rows[r]), pos, 1, p)) for r, pos, _ in kept]
    total = sum(k for _, k in wanted)
    if total * p > len(state.free_slots):
        short = next(r for r, k in wanted if k)
        raise OutOfMemory(op, "host", total, len(state.free_slots) // p, request=short)
    written: list[int] = []
    for r, pos, v in kept:
        state, slots = alloc_paged_token_slots(state, r, pos, 1)
        state = set_host_data(state, slots, [v])
        written += slots
    return state, tuple(written)


def _backup_token_granular(state: HostPoolState, kept: list[tuple[int, int, int]]
                           ) -> tuple[HostPoolState, tuple[int, ...]]:
    """Pre-#23606: ``alloc(#reqs)`` for the batch, then ``table[r, pos] = slot`` (token-granular)."""
    op = "eager_backup_previous_token"
    for r, pos, _ in kept:
        # the scatter writes table[r, pos]: positions already in the row are overwritten, later ones leave holes
        require(pos <= len(state.rows[r]), op, "seq_lens",
                f"position {pos} of request slot {r} > row length {len(state.rows[r])} (hole)")
    fresh = [(r, pos, v) for r, pos, v in kept if pos == len(state.rows[r])]
    state, slots = alloc(state, len(fresh), req=fresh[0][0] if fresh else None)
    at, written = 0, []
    for r, pos, v in kept:
        if pos == len(state.rows[r]):
            state = _set_row(state, r, state.rows[r] + (slots[at],))
            at += 1
        slot = state.rows[r][pos]
        state = set_host_data(state, [slot], [v])
        written.append(slot)
    return state, tuple(written)


def _set_row(state: HostPoolState, req: int, row: tuple[int, ...]) -> HostPoolState:
    rows = list(state.rows)
    rows[req] = tuple(row)
    return state.model_copy(update={"rows": tuple(rows)})


# ---------------------------------------------------------------- invariants (§4.6)


def check_host_snapshot(snap: HostPoolSnapshot, transfer_page_size: int | None = None) -> None:
    """H0-H3 on any implementation's snapshot; raises :class:`InvariantViolation`.

    H0: the free list is a concatenation of aligned page runs. H1: each allocated
    length is a multiple of P_h, the row is valid exactly below it, each aligned
    block is one aligned host page (also at ``transfer_page_size`` when given: the
    page rule of page transfers). H2: rows and free list partition the pool.
    """
    p, free = snap.page_size, snap.free_slots
    runs_ok = len(free) % p == 0 and all(free[i] % p == 0 and free[i:i + p] == tuple(range(free[i], free[i] + p))
                                         for i in range(0, len(free), p))
    ensure(runs_ok, "H0", f"free list is not a concatenation of aligned {p}-slot pages: {_head(free)}")
    owned: list[int] = []
    for r, (n, row) in enumerate(zip(snap.allocated_len, snap.rows, strict=True)):
        valid = row[:n]
        ensure(n % p == 0, "H1", f"request slot {r}: allocated length {n} is not a multiple of page size {p}")
        ensure(all(s >= 0 for s in valid) and all(s == -1 for s in row[n:]), "H1",
               f"request slot {r}: row is not valid exactly on [0, {n}): {_head(row)}")
        for q in {p, transfer_page_size or p}:
            for b in range(0, n - n % q, q):
                block = valid[b:b + q]
                ensure(block[0] % q == 0 and block == tuple(range(block[0], block[0] + q)), "H1",
                       f"request slot {r}: positions [{b}, {b + q}) are not one aligned {q}-slot page: "
                       f"{_head(block)}")
        owned += valid
    everything = sorted(owned + list(free))
    dup = sorted({s for s in owned if owned.count(s) > 1} | (set(owned) & set(free)))
    ensure(not dup, "H2", f"host slots owned twice or owned and free: {dup[:8]}")
    ensure(everything == list(range(snap.size)), "H2",
           f"free + owned = {len(everything)} slots, pool has {snap.size} (leak or foreign slot)")


def check_host_pool(state: HostPoolState) -> None:
    """H0-H3 on the reference state (H3: an empty row has no skip flag)."""
    check_host_snapshot(snapshot(state), state.config.transfer_page_size)
    for r, row in enumerate(state.rows):
        ensure(bool(row) or not state.skip_first_backup[r], "H3", f"request slot {r} is empty but flagged")


# ---------------------------------------------------------------- preconditions


def _check_req(state: HostPoolState, op: str, req: int) -> None:
    # request slots index req_to_host_pool's rows
    require(0 <= req < state.config.max_req_slots, op, "req",
            f"request slot {req} out of range [0, {state.config.max_req_slots})")


def _check_slots(state: HostPoolState, op: str, slots: Sequence[int]) -> None:
    owned = {s for row in state.rows for s in row}
    bad = [s for s in slots if s not in owned]
    # data moves only into host slots some request owns
    require(not bad, op, "slots", f"host slots {bad[:8]} are not allocated to any request")


def _head(values: Sequence[int], n: int = 12) -> str:
    shown = ", ".join(map(str, values[:n]))
    return f"[{shown}{', ...' if len(values) > n else ''}] ({len(values)} entries)"

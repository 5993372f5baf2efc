"""``loc_cache``: every transition accepts the reference's steps on sampled runs (sglang_semantics.md §3, §7 C1-C4).

Seeded random runs of ``kvproof.reference.loc_cache`` on the bounded instance of
``kvproof.spec.loc_cache``: page size 2 and 4 tokens per pool (full slots 0..5, the
model's ``NF``), index memory of three int64 elements at 1024, 1032, 1040 (the model's
``ADDRS``), views of at most 2 elements, requests of at most 4 tokens. The caller
holds the views it made (``make_view``) and its latest ``backup_state()``, and keeps
the environment contract E1 (the scheduler translates for a pool only in its quiet
phase; the run tracks the phase as the model does: address reuse or an in-place write
starts batch preparation, a forward or replay ends pool 0's). Arguments are mostly
valid; the reference decides, and a rejected call is skipped.

Each step that succeeds gives a (pre, post) pair of concrete systems; both are
encoded into the model's state (ghost fields the reference lacks -- the view a cache
entry came from -- stay free) and :func:`kvproof.spec._ts.accepts` asks whether the
transition of the same name relates them, with the call's arguments pinned where the
model has them. Runs use the upstream policy and three broken ones (a point removed,
the storage-base key, one cache for both pools), each encoded as the model's
:class:`~kvproof.spec.loc_cache.Variant`. Deliberately wrong transitions (the twins'
broken ops) must reject some sampled step: the test can fail.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import z3

from kvproof.reference import loc_cache as ref
from kvproof.reference import swa_allocator as sa
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.spec import _ts
from kvproof.spec import loc_cache as lc
from kvproof.spec.loc_cache import ADDRS, NF, REAL_SLOTS, RESERVED, Action, K, State, Variant, byte_address

P = 2
CONFIG = PoolConfig(size_full=NF - P, size_swa=NF - P, page_size=P, sliding_window_size=2)
SWA_LAYER = CONFIG.kv.swa_attention_layer_ids[0]
MAX_SEQ = 4
SEEDS = range(10)
STEPS = 40

#: The sampled policies and the model variant of each (``test_loc_cache.py``'s mapping, spelled out).
POLICIES: dict[str, ref.LocCachePolicy] = {
    "upstream": ref.LocCachePolicy(),
    "without_alloc": ref.LocCachePolicy().without(ref.InvalidationPoint.ALLOC),
    "storage_base": ref.LocCachePolicy(key_scheme=ref.KeyScheme.STORAGE_BASE),
    "shared": ref.LocCachePolicy(shared_across_pools=True),
}
BROKEN_SEEDS = range(100, 103)


def variant(policy: ref.LocCachePolicy) -> Variant:
    return Variant(policy=lc.Policy(points=frozenset(lc.Point(p.value) for p in policy.invalidate_at),
                                    key_scheme=lc.KeyScheme(policy.key_scheme.value),
                                    shared_across_pools=policy.shared_across_pools))


Facts = list[z3.BoolRef]


def element(address: int) -> int:
    """The model's element address of a byte address (``byte_address`` inverted)."""
    a, rest = divmod(address - byte_address(0), lc.ELEMENT_BYTES)
    assert rest == 0 and a in ADDRS, f"byte address {address} is outside the model's index memory"
    return a


@dataclass
class Run:
    """One seeded run: the reference system, the E1 phase per pool, and what the caller holds."""

    rng: random.Random
    system: ref.LocCacheSystem
    quiet: tuple[bool, bool] = (True, True)
    used: set[int] = field(default_factory=set)  # elements ever allocated
    backup: sa.AllocatorBackup | None = None
    views: list[ref.IndexView] = field(default_factory=list)

    def live(self) -> list[int]:
        return [x for x in REAL_SLOTS if sa.is_live(self.system.allocator, x)]

    def storages(self) -> list[int]:
        return [sid for sid, s in enumerate(self.system.memory.storages) if s.alive]

    def held_views(self) -> list[ref.IndexView]:
        """The views the caller made whose storage is still live."""
        return [v for v in self.views if self.system.memory.storages[v.storage].alive]

    def contents(self, view: ref.IndexView) -> tuple[int, ...]:
        return ref.view_contents(self.system.memory, view)


def encode(run: Run) -> Callable[[State], Facts]:
    """Facts pinning a model state to the run's reference system, E1 phase and held backup (taken now)."""
    system, quiet, backup = run.system, run.quiet, run.backup
    allocator, mapping = system.allocator, system.allocator.full_to_swa_index_mapping

    def facts(s: State) -> Facts:
        assert mapping[-1] == -1 and len(mapping) == NF + 1, "the model's slots and sentinel"
        assert all(mapping[x] == 0 and not sa.is_live(allocator, x) for x in RESERVED)
        out: Facts = [s.M[x] == mapping[x] for x in REAL_SLOTS]
        out += [s.live[x] == sa.is_live(allocator, x) for x in REAL_SLOTS]
        out += [s.M2[x] == system.other_mapping[x] for x in REAL_SLOTS]
        for a in ADDRS:
            covering = [st for st in system.memory.storages
                        if element(st.base) <= a < element(st.base) + len(st.contents)]
            out += [s.used[a] == bool(covering), s.alive[a] == bool(covering and covering[-1].alive)]
            if covering:  # the latest storage over the element wrote it last (freed ones keep their contents)
                st = covering[-1]
                out += [s.cont[a] == st.contents[a - element(st.base)], s.base[a] == element(st.base)]
        for cache, c in zip(system.caches, s.caches, strict=False):  # shared policy: one cache, pool 1's is free
            if cache.key is None or cache.value is None:
                out.append(z3.Not(c.valid))
                continue
            ptr, numel = cache.key
            out += [c.valid, c.addr == element(ptr), c.numel == numel, c.pool == cache.pool]
            out += [c.value[j] == (cache.value[j] if j < numel else 0) for j in range(K)]
        out += [s.quiet[0] == quiet[0], s.quiet[1] == quiet[1]]
        g = system.graph
        if g is None:
            out.append(z3.Not(s.graph.captured))
        else:
            n = g.loc.numel
            out += [s.graph.captured, s.graph.recorded == g.recorded_gather,
                    s.graph.addr == element(ref.data_ptr(system.memory, g.loc)), s.graph.numel == n]
            out += [s.graph.constant[j] == (g.constant[j] if j < n else 0) for j in range(K)]
        out.append(s.bk_held == (backup is not None))
        if backup is not None:
            out += [s.bk_live[x] == (x // P not in backup.full_free_pages and x % P < backup.fill[x // P])
                    for x in REAL_SLOTS]
        return out

    return facts


@dataclass(frozen=True)
class Call:
    """One sampled call: the op, how to run it on the reference, and the facts its arguments give the action."""

    op: str
    apply: Callable[[Run], None]
    args: Callable[[Action], Facts]
    text: str


def _view_args(run: Run, view: ref.IndexView) -> Callable[[Action], Facts]:
    addr = element(ref.data_ptr(run.system.memory, view))
    return lambda a: [a.addr == addr, a.numel == view.numel]


def _rows(n: int) -> dict[int, tuple[list[list[float]], list[list[float]]]]:
    """KV rows of the SWA layer for ``n`` tokens (the layer that translates)."""
    width = CONFIG.kv.row_width
    return {SWA_LAYER: ([[1.0] * width] * n, [[2.0] * width] * n)}


def _contents(run: Run, n: int) -> list[int]:
    """New index contents: -1 (no prefix), padding 0, live slots (last-live ones for extends), any slot."""
    last = [x for x in run.live() if run.system.allocator.fill[x // P] == x % P + 1]
    pools = [[-1], [0], run.live() or [0], last or [-1], list(range(-1, NF))]
    return [run.rng.choice(run.rng.choice(pools)) for _ in range(n)]


def _extend(run: Run, contents: Sequence[int], decode: bool) -> tuple[list[int], list[int]]:
    """``prefix_lens`` / ``seq_lens`` that fit ``last_loc`` contents: -1 starts a request, a slot continues after it."""
    prefix = [0 if x == -1 else run.rng.choice([x % P + 1, x % P + 1 + P]) for x in contents]
    seq = [p + 1 if decode else run.rng.randint(p, MAX_SEQ) for p in prefix]
    return prefix, seq


#: How often each op is drawn: the view ops need storages and views first, resets undo a run's progress.
WEIGHTS: dict[str, float] = {
    "new_storage": 4, "free_storage": 1, "write_index": 1, "make_view": 5, "invalidate_loc_cache": 1,
    "translate_loc_from_full_to_swa": 6, "forward": 3, "capture": 3, "replay": 4, "alloc": 2, "alloc_extend": 4,
    "alloc_decode": 3, "alloc_extend_swa_tail": 1, "free": 1, "free_swa": 1, "free_full": 1,
    "set_full_to_swa_mapping": 1, "clear": 0.5, "backup_state": 1, "restore_state": 3, "register_mapping": 0.5,
}


def _set(run: Run, system: ref.LocCacheSystem) -> None:
    run.system = system


def _suited(run: Run, views: list[ref.IndexView], fits: Callable[[int], bool]) -> ref.IndexView:
    """A view whose every element ``fits`` (the op's precondition on contents), else any view."""
    good = [v for v in views if all(fits(x) for x in run.contents(v))]
    return run.rng.choice(good or views)


def sample(run: Run) -> Call | None:
    """A random call with mostly valid arguments, or None if the op has nothing to act on yet."""
    rng, live, storages, views = run.rng, run.live(), run.storages(), run.held_views()
    op = rng.choices(lc.OPS, weights=[WEIGHTS[op] for op in lc.OPS])[0]

    def mutate(f: Callable[[ref.LocCacheSystem], ref.LocCacheSystem]) -> Callable[[Run], None]:
        return lambda r: _set(r, f(r.system))

    if op == "new_storage":
        base = rng.choice(list(ADDRS))
        contents = _contents(run, rng.randint(1, len(ADDRS) - base))

        def new(r: Run) -> None:
            r.system, _ = ref.new_storage(r.system, byte_address(base), contents)
            covered = set(range(base, base + len(contents)))
            if covered & r.used:  # address reuse: index memory rewritten (E1)
                r.quiet = (False, False)
            r.used |= covered
        return Call(op, new, lambda a: [a.addr == base, a.numel == len(contents),
                                        *[a.data[i] == x for i, x in enumerate(contents)]],
                    f"new_storage({byte_address(base)}, {contents})")
    if op == "free_storage" and storages:
        sid = rng.choice(storages)
        base = element(run.system.memory.storages[sid].base)
        return Call(op, mutate(lambda s: ref.free_storage(s, sid)), lambda a: [a.addr == base],
                    f"free_storage({sid})")
    if op == "write_index" and storages:
        sid = rng.choice(storages)
        st = run.system.memory.storages[sid]
        offset, value = rng.randrange(len(st.contents)), _contents(run, 1)[0]

        def write(r: Run) -> None:
            r.system = ref.write_index(r.system, sid, offset, [value])
            r.quiet = (False, False)
        return Call(op, write, lambda a: [a.addr == element(st.base) + offset, a.data[0] == value],
                    f"write_index({sid}, {offset}, [{value}])")
    if op == "make_view" and storages:
        sid = rng.choice(storages)
        size = len(run.system.memory.storages[sid].contents)
        offset = rng.randrange(size)
        numel = rng.randint(1, min(K, size - offset))
        view = ref.make_view(run.system, sid, offset, numel)
        return Call(op, lambda r: r.views.append(view), _view_args(run, view), f"make_view({sid}, {offset}, {numel})")
    if op == "invalidate_loc_cache":
        pool = rng.choice([0, 1])
        return Call(op, mutate(lambda s: ref.invalidate_loc_cache(s, pool=pool)), lambda a: [a.pool == pool],
                    f"invalidate_loc_cache(pool={pool})")
    if op == "translate_loc_from_full_to_swa" and views:
        quiet = [p for p in (0, 1) if run.quiet[p]]  # E1: the scheduler translates in its pool's quiet phase
        if not quiet:
            return None
        view, pool = rng.choice(views), rng.choice(quiet)
        args = _view_args(run, view)
        return Call(op, mutate(lambda s: ref.translate_loc_from_full_to_swa(s, view, pool=pool)[0]),
                    lambda a: [*args(a), a.pool == pool], f"translate({view}, pool={pool})")
    if op == "forward" and views:
        view = _suited(run, views, lambda x: x == 0 or x in live)
        args = _view_args(run, view)

        def forward(r: Run) -> None:
            r.system = ref.forward(r.system, view, _rows(view.numel))
            r.quiet = (True, r.quiet[1])
        return Call(op, forward, lambda a: [*args(a), a.pool == 0], f"forward({view} = {run.contents(view)})")
    if op == "capture" and views:
        view = _suited(run, views, lambda x: x == 0)
        return Call(op, mutate(lambda s: ref.capture(s, view)), _view_args(run, view), f"capture({view})")
    if op == "replay" and run.system.graph is not None:
        n = run.system.graph.loc.numel

        def replay(r: Run) -> None:
            r.system = ref.replay(r.system, _rows(n))
            r.quiet = (True, r.quiet[1])
        return Call(op, replay, lambda a: [], "replay()")
    if op == "alloc":
        need = rng.choice([0, P, 2 * P])
        return Call(op, mutate(lambda s: ref.alloc(s, need)[0]), lambda a: [], f"alloc({need})")
    if op in ("alloc_extend", "alloc_decode") and views:
        fill = run.system.allocator.fill
        view = _suited(run, views, lambda x: x == -1 or (x in live and fill[x // P] == x % P + 1))
        prefix, seq = _extend(run, run.contents(view), decode=op == "alloc_decode")
        if op == "alloc_extend":
            def extend(s: ref.LocCacheSystem) -> ref.LocCacheSystem:
                return ref.alloc_extend(s, prefix, seq, view, sum(seq) - sum(prefix))[0]
        else:
            def extend(s: ref.LocCacheSystem) -> ref.LocCacheSystem:
                return ref.alloc_decode(s, seq, view)[0]
        return Call(op, mutate(extend), _view_args(run, view),
                    f"{op}({prefix}, {seq}, last_loc {run.contents(view)})")
    if op == "alloc_extend_swa_tail":
        seq = rng.randint(1, MAX_SEQ)
        tail = rng.choice([t for t in range(seq + 1) if (seq - t) % P == 0])
        return Call(op, mutate(lambda s: ref.alloc_extend_swa_tail(s, [0], [seq], [-1], seq, tail)[0]),
                    lambda a: [], f"alloc_extend_swa_tail(0, {seq}, tail={tail})")
    if op in ("free", "free_swa", "free_full"):
        slots = rng.sample(live, rng.randint(0, min(len(live), 3)))
        fn = {"free": ref.free, "free_swa": ref.free_swa, "free_full": ref.free_full}[op]
        return Call(op, mutate(lambda s: fn(s, slots)), lambda a: [], f"{op}({slots})")
    if op == "set_full_to_swa_mapping":
        slots = rng.sample(live, rng.randint(0, min(len(live), 2)))
        mapping = run.system.allocator.full_to_swa_index_mapping
        values = [rng.choice([mapping[x], 0, mapping[x] ^ 1, rng.choice(list(REAL_SLOTS))]) for x in slots]
        return Call(op, mutate(lambda s: ref.set_full_to_swa_mapping(s, slots, values)), lambda a: [],
                    f"set_full_to_swa_mapping({slots}, {values})")
    if op in ("clear", "register_mapping"):
        fn = ref.clear if op == "clear" else ref.register_mapping
        return Call(op, mutate(fn), lambda a: [], f"{op}()")
    if op == "backup_state":
        def take(r: Run) -> None:
            r.backup = ref.backup_state(r.system)
        return Call(op, take, lambda a: [], "backup_state()")
    if op == "restore_state" and run.backup is not None:
        backup = run.backup
        return Call(op, mutate(lambda s: ref.restore_state(s, backup)), lambda a: [], "restore_state(backup)")
    return None


@dataclass(frozen=True)
class Pair:
    """One successful reference step, encoded for the model."""

    op: str
    text: str
    pre: Callable[[State], Facts]
    post: Callable[[State], Facts]
    args: Callable[[Action], Facts]


def next_call(run: Run) -> Call:
    """Draw ops until one has something to act on (new_storage always has)."""
    while (call := sample(run)) is None:
        pass
    return call


def sampled_pairs(policy: ref.LocCachePolicy, seed: int, steps: int = STEPS) -> list[Pair]:
    run, pairs = Run(random.Random(seed), ref.initial_system(CONFIG, policy)), []
    for _ in range(steps):
        call = next_call(run)
        pre = encode(run)
        try:
            call.apply(run)
        except (InvalidOperation, OutOfMemory):
            continue
        pairs.append(Pair(call.op, call.text, pre, encode(run), call.args))
    return pairs


@functools.cache
def all_pairs(name: str = "upstream") -> tuple[Pair, ...]:
    seeds = SEEDS if name == "upstream" else [seed + 10 * list(POLICIES).index(name) for seed in BROKEN_SEEDS]
    return tuple(pair for seed in seeds for pair in sampled_pairs(POLICIES[name], seed))


def test_sampled_runs_exercise_every_transition() -> None:
    counts = Counter(pair.op for pair in all_pairs())
    missing = set(lc.OPS) - set(counts)
    assert not missing, f"never sampled successfully: {sorted(missing)} ({dict(counts)})"


@pytest.mark.parametrize("seed", SEEDS)
def test_every_transition_accepts_the_reference_steps(seed: int) -> None:
    for i, pair in enumerate(sampled_pairs(POLICIES["upstream"], seed)):
        verdict = _ts.accepts(lc.SYSTEM, pair.op, pair.pre, pair.post, pair.args)
        assert verdict.accepted, f"seed {seed}, step {i}: {pair.text}: {verdict}"


@pytest.mark.parametrize("name", [name for name in POLICIES if name != "upstream"])
def test_broken_policies_are_the_variants_of_the_same_name(name: str) -> None:
    """The policy parameter drifts neither: runs of a broken reference policy are runs of its model variant."""
    system = lc.system(variant(POLICIES[name]))
    for i, pair in enumerate(all_pairs(name)):
        verdict = _ts.accepts(system, pair.op, pair.pre, pair.post, pair.args)
        assert verdict.accepted, f"{name}, step {i}: {pair.text}: {verdict}"


def test_free_after_restore_state_zeroes_a_dead_slot() -> None:
    """A drift the sampled runs can miss, kept as a fixed case: ``restore_state`` leaves a dead slot mapped (R3), and
    ``free`` of its page zeroes it; the model's ``free`` once zeroed live slots only."""
    run = Run(random.Random(0), ref.initial_system(CONFIG))
    run.system, sid = ref.new_storage(run.system, byte_address(0), [-1])
    view = ref.make_view(run.system, sid, 0, 1)
    run.system, (slot,) = ref.alloc_extend(run.system, [0], [1], view, 1)
    run.backup = ref.backup_state(run.system)
    run.system = ref.write_index(run.system, sid, 0, [slot])
    run.quiet = (False, False)
    run.system, (draft,) = ref.alloc_extend(run.system, [1], [2], view, 1)  # the same page: slot + 1
    run.system = ref.restore_state(run.system, run.backup)
    assert run.system.allocator.full_to_swa_index_mapping[draft] > 0 and draft not in run.live()
    pre = encode(run)
    run.system = ref.free(run.system, [slot])
    assert run.system.allocator.full_to_swa_index_mapping[draft] == 0
    verdict = _ts.accepts(lc.SYSTEM, "free", pre, encode(run))
    assert verdict.accepted, str(verdict)


#: Deliberately wrong transitions (the twins' broken ops): each must reject some sampled step of its op.
WRONG = {
    "new_storage": Variant(reuse_rewrites=False),
    "free_storage": Variant(free_scrubs=True),
    "invalidate_loc_cache": Variant(invalidate_ignores_pool=True),
    "translate_loc_from_full_to_swa": Variant(policy=lc.Policy(key_scheme=lc.KeyScheme.STORAGE_BASE)),
    "capture": Variant(policy=lc.Policy().without(lc.Point.RUN_ONCE)),
    "replay": Variant(replay_invalidates=False),
    "alloc": Variant(policy=lc.Policy().without(lc.Point.ALLOC)),
    "free": Variant(policy=lc.Policy().without(lc.Point.FREE_SWA)),
}


@pytest.mark.parametrize("op", sorted(WRONG))
def test_a_wrong_transition_rejects_some_reference_step(op: str) -> None:
    wrong = lc.SYSTEM.with_transitions(**{op: lc.system(WRONG[op]).transitions[op]})
    verdicts = [_ts.accepts(wrong, op, p.pre, p.post, p.args) for p in all_pairs() if p.op == op]
    assert verdicts, f"no sampled {op} step"
    rejected = [v for v in verdicts if not v.accepted]
    assert rejected, f"the broken {op} accepts all {len(verdicts)} sampled steps: the drift test cannot fail"
    assert rejected[0].status == "rejected" and rejected[0].conflict, str(rejected[0])

"""The Z3 terms of kvproof.spec and the pure-Python reference must not drift.

Each builder in ``kvproof.spec.terms`` is evaluated on concrete integers with
``z3.simplify`` and compared with ``kvproof.reference.arith`` (sglang_semantics.md
§1.3, §2.3); the ``swa_mask`` selection encoding is compared with a direct Python
rendering of ``get_cpu_copy`` / ``load_cpu_copy`` (§2.8).
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import z3
from hypothesis import given
from hypothesis import strategies as st

from kvproof.reference import arith
from kvproof.reference import swa_allocator as sa
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.spec import _ts, swa_mask, swa_s3
from kvproof.spec._solver import closed_value as value
from kvproof.spec.swa_s3 import ARGS, MAX_SEQ, PAGES, REAL_SLOTS, Action, State, Variant
from kvproof.spec.terms import (
    ceil_div_term,
    ceil_p_term,
    decode_opens_page_term,
    extend_parts_terms,
    floor_p_term,
    is_multiple_term,
    new_pages_of_parts,
    num_new_pages_term,
    swa_tail_term,
)

pages = st.integers(1, 300)
lengths = st.integers(0, 20_000)




@given(L=st.integers(-5, 20_000), W=st.integers(1, 5_000), P=pages)
def test_swa_tail_term(L: int, W: int, P: int) -> None:
    assert value(swa_tail_term(L, W, P)) == arith.swa_tail_len(L, W, P)


def test_swa_tail_term_on_scenario_s1() -> None:
    table = {1: 1, 100: 100, 191: 191, 192: 128, 200: 136, 255: 191, 256: 128, 8192: 128, 8200: 136}
    assert {L: value(swa_tail_term(L, 128, 64)) for L in table} == table


@given(n=lengths, P=pages)
def test_rounding_terms(n: int, P: int) -> None:
    assert value(ceil_div_term(n, P)) == arith.ceil_div(n, P)
    assert value(ceil_p_term(n, P)) == arith.ceil_p(n, P)
    assert value(floor_p_term(n, P)) == arith.floor_p(n, P)
    assert value(is_multiple_term(n, P)) == (n % P == 0)


@given(data=st.data(), P=pages)
def test_extend_terms(data: st.DataObject, P: int) -> None:
    s = data.draw(lengths, label="seq_len")
    p = data.draw(st.integers(0, s), label="prefix_len")
    parts = extend_parts_terms(p, s, P)
    assert tuple(value(n) for n in parts) == arith.extend_parts(p, s, P)
    assert value(num_new_pages_term(p, s, P)) == arith.num_new_pages(p, s, P)
    assert value(new_pages_of_parts(parts[1], parts[2], P)) == arith.num_new_pages(p, s, P)


@given(s=st.integers(1, 20_000), P=pages)
def test_decode_term(s: int, P: int) -> None:
    assert value(decode_opens_page_term(s, P)) == arith.decode_opens_page(s, P)
    assert arith.decode_opens_page(s, P) == (arith.num_new_pages(s - 1, s, P) == 1)


def _python_load(old: list[bool], new: list[bool]) -> tuple[list[int], list[int]]:
    """§2.8 in plain Python: rows by source position, destinations by position."""
    saved = [j for j, bit in enumerate(old) if bit]
    row_mask = [new[j] for j in saved]  # new_mask[old_mask]
    rows = [j for j, keep in zip(saved, row_mask, strict=True) if keep]
    dest = [j for j, keep in zip(saved, row_mask, strict=True) if keep]  # t[old_mask][row_mask]
    return rows, dest


def _two_masks(n: int) -> st.SearchStrategy[tuple[list[bool], list[bool]]]:
    mask = st.lists(st.booleans(), min_size=n, max_size=n)
    return st.tuples(mask, mask)


masks = st.integers(1, swa_mask.MAX_LEN).flatmap(_two_masks)


@functools.cache
def _symbolic_mask_model() -> tuple[swa_mask.MaskCase, swa_mask.Load, tuple[z3.ArithRef, ...], z3.ArithRef]:
    """The symbolic copy/load terms, built once; examples substitute concrete masks."""
    case = swa_mask.MaskCase.fresh()
    return (case, swa_mask.load_cpu_copy(case), *swa_mask.copy(case))


@given(masks=masks)
def test_swa_mask_encoding(masks: tuple[list[bool], list[bool]]) -> None:
    old, new = masks
    pad = [False] * (swa_mask.MAX_LEN - len(old))
    case, load, saved, num_saved = _symbolic_mask_model()
    concrete = [(case.n, z3.IntVal(len(old)))]
    concrete += [(var, z3.BoolVal(bit)) for var, bit in zip(case.old + case.new, old + pad + new + pad, strict=True)]

    def at(term: z3.ExprRef) -> int | bool:
        return value(z3.substitute(term, *concrete))

    rows = [at(x) for x in load.rows[: at(load.num_rows)]]
    dest = [at(x) for x in load.dest[: at(load.num_dest)]]
    expected_rows, expected_dest = _python_load(old, new)
    if not any(old) or not expected_dest:  # swa is None, or no destinations: load returns early
        expected_rows, expected_dest = [], []
    assert (rows, dest) == (expected_rows, expected_dest)
    assert [at(x) for x in saved[: at(num_saved)]] == [j for j, bit in enumerate(old) if bit]


# ---- swa_allocator: every transition accepts the reference's steps ---------------------------------------------
#
# Seeded random runs of kvproof.reference.swa_allocator on the bounded instance of kvproof.spec.swa_s3 (page size 2,
# 3 pages per pool, requests of <= 4 tokens, list arguments of <= 4 entries, one request per allocation). Each step
# that succeeds gives a (pre, post) pair and the call's arguments; both states are encoded into the model's state
# (the ghost page index stays free; the caller's backup and CPU copy are encoded from what the run holds) and the
# transition of the same name must accept the pair (sglang_semantics.md §1.3-§1.6, §2.7, §2.8).

P = swa_s3.P
CONFIG = PoolConfig(size_full=P * len(PAGES), size_swa=P * len(PAGES), page_size=P, sliding_window_size=4)
FULL_LAYER, SWA_LAYER = CONFIG.kv.full_attention_layer_ids[0], CONFIG.kv.swa_attention_layer_ids[0]
SEEDS = range(16)
STEPS = 30

Facts = list[z3.BoolRef]


@dataclass
class Run:
    """One seeded run: the reference state, what the caller holds, and the row tags seen so far."""

    rng: random.Random
    state: sa.SWAAllocatorState = field(default_factory=lambda: sa.initial_state(CONFIG))
    backup: sa.AllocatorBackup | None = None
    copy: sa.KVCpuCopy | None = None
    tags: dict[tuple[float, ...], int] = field(default_factory=dict)

    def tag(self, row: Sequence[float] | None) -> int:
        return 0 if row is None else self.tags.setdefault(tuple(row), len(self.tags) + 1)

    def pages(self) -> list[int]:
        """Allocated full pages."""
        return [g for g in PAGES if self.state.full.is_allocated(g)]

    def live(self) -> list[int]:
        return [x for x in REAL_SLOTS if sa.is_live(self.state, x)]

    def row(self) -> tuple[float, ...]:
        return tuple(float(self.rng.randrange(100)) for _ in range(2 * CONFIG.kv.row_width))


def encode_state(run: Run, state: sa.SWAAllocatorState, backup: sa.AllocatorBackup | None,
                 copy: sa.KVCpuCopy | None) -> Callable[[State], Facts]:
    """Facts pinning a model state to the reference's (and to the backup and copy the caller holds)."""

    def facts(s: State) -> Facts:
        mapping, kv = state.full_to_swa_index_mapping, state.kv.layers
        assert mapping[-1] == -1 and all(m == 0 for m in mapping[:P]), "sentinel and page 0 are constants"
        out: Facts = []
        for g in PAGES:
            out += [s.full_free[g] == (g in state.full.free_pages), s.swa_free[g] == (g in state.swa.free_pages),
                    s.full_owner[g] == (state.full.owner[g] or 0), s.swa_owner[g] == (state.swa.owner[g] or 0)]
        for x in REAL_SLOTS:
            out += [s.M[x] == mapping[x], s.live[x] == sa.is_live(state, x),
                    s.kv_full[x] == run.tag(kv[FULL_LAYER][x]), s.kv_swa[x] == run.tag(kv[SWA_LAYER][x])]
        out.append(s.bk_held == (backup is not None))
        if backup is not None:
            out.append(s.backup == (backup.epoch == state.epoch))
            out += [s.bk_full_free[g] == (g in backup.full_free_pages) for g in PAGES]
            out += [s.bk_swa_free[g] == (g in backup.swa_free_pages) for g in PAGES]
            out += [s.bk_live[x] == (x % P < backup.fill[x // P]) for x in REAL_SLOTS]
        out += encode_copy(run, copy, s)
        return out

    return facts


def encode_copy(run: Run, copy: sa.KVCpuCopy | None, s: State) -> Facts:
    """A held ``KVCpuCopy`` per position: full row, mask bit, and the SWA row of a masked position."""
    mask = copy.swa_mask if copy is not None else ()
    saved = iter(copy.swa[0] if copy is not None and copy.swa is not None else ())
    out: Facts = [s.copy_len == len(mask)]
    for j in range(ARGS):
        on = j < len(mask)
        full = run.tag(copy.full[0][j]) if copy is not None and on else 0
        swa = run.tag(next(saved)) if on and mask[j] else 0
        out += [s.copy_full[j] == full, s.copy_mask[j] == (on and mask[j]), s.copy_swa[j] == swa]
    return out


@dataclass(frozen=True)
class Call:
    """One sampled call: the op, how to run it on the reference, and the facts its arguments give the action."""

    op: str
    apply: Callable[[Run], None]
    args: Callable[[Action], Facts]
    text: str


def _list_args(a: Action, loc: Sequence[int], value: Sequence[int] = (), result: Sequence[int] = ()) -> Facts:
    out: Facts = [a.n == len(loc), *[a.loc[i] == x for i, x in enumerate(loc)]]
    out += [a.value[i] == v for i, v in enumerate(value)] + [a.result[i] == r for i, r in enumerate(result)]
    return out


def _pages_of(slots: Sequence[int]) -> Callable[[Action], Facts]:
    touched = {x // P for x in slots}
    return lambda a: [a.pages[g] == (g in touched) for g in PAGES]


def _extension(run: Run) -> tuple[int, int, int]:
    """``(prefix, last_loc, room)`` of a new request, or of one continuing an allocated page after its last live
    slot (prefix consistent with that slot's offset; ``room``: tokens it may still take)."""
    pages = run.pages()
    if not pages or run.rng.random() < 0.4:
        return 0, -1, MAX_SEQ
    g = run.rng.choice(pages)
    fill = run.state.fill[g]
    prefix = run.rng.choice([p for p in (fill, fill + P) if p < MAX_SEQ])
    return prefix, g * P + fill - 1, MAX_SEQ - prefix


def sample(run: Run) -> Call:
    """A random call with mostly valid arguments (the reference decides; rejected calls are skipped)."""
    rng, live = run.rng, run.live()
    held = {"restore_state": run.backup is not None, "load_cpu_copy": run.copy is not None}
    op = rng.choice([op for op in swa_s3.OPS if held.get(op, True)])

    def mutate(f: Callable[[sa.SWAAllocatorState], sa.SWAAllocatorState]) -> Callable[[Run], None]:
        def apply(r: Run) -> None:
            r.state = f(r.state)
        return apply

    if op == "alloc":
        need = rng.choice([0, P, 2 * P])
        return Call(op, mutate(lambda s: sa.alloc(s, need)[0]), lambda a: [a.prefix == 0, a.seq == need],
                    f"alloc({need})")
    if op in ("alloc_extend", "alloc_decode", "alloc_extend_swa_tail"):
        prefix, last, room = _extension(run)
        seq = prefix + (1 if op == "alloc_decode" else rng.randint(0, room))
        if op == "alloc_extend":
            return Call(op, mutate(lambda s: sa.alloc_extend(s, [prefix], [seq], [last], seq - prefix)[0]),
                        lambda a: [a.prefix == prefix, a.seq == seq], f"alloc_extend({prefix}, {seq}, {last})")
        if op == "alloc_decode":
            return Call(op, mutate(lambda s: sa.alloc_decode(s, [seq], [last])[0]), lambda a: [a.seq == seq],
                        f"alloc_decode({seq}, {last})")
        tail = rng.choice([t for t in range(seq - prefix + 1) if (seq - t) % P == 0] or [0])
        return Call(op, mutate(lambda s: sa.alloc_extend_swa_tail(s, [prefix], [seq], [last], seq - prefix, tail)[0]),
                    lambda a: [a.prefix == prefix, a.seq == seq, a.tail == tail],
                    f"alloc_extend_swa_tail({prefix}, {seq}, {last}, tail={tail})")
    if op in ("free", "free_swa", "free_full"):
        slots = rng.sample(live, rng.randint(0, min(len(live), 3)))
        fn = {"free": sa.free, "free_swa": sa.free_swa, "free_full": sa.free_full}[op]
        return Call(op, mutate(lambda s: fn(s, slots)), _pages_of(slots), f"{op}({slots})")
    if op == "clear":
        return Call(op, mutate(sa.clear), lambda a: [], "clear()")
    if op == "backup_state":
        def take_backup(r: Run) -> None:
            r.backup = sa.backup_state(r.state)
        return Call(op, take_backup, lambda a: [], "backup_state()")
    if op == "restore_state":
        backup = run.backup
        assert backup is not None
        return Call(op, mutate(lambda s: sa.restore_state(s, backup)), lambda a: [], "restore_state(backup)")
    if op == "set_full_to_swa_mapping":
        slots = rng.sample(live, rng.randint(0, min(len(live), 2)))
        mapping = run.state.full_to_swa_index_mapping
        values = [rng.choice([mapping[x], 0, mapping[x] ^ 1, rng.choice(list(REAL_SLOTS))]) for x in slots]
        return Call(op, mutate(lambda s: sa.set_full_to_swa_mapping(s, slots, values)),
                    lambda a: _list_args(a, slots, values), f"set_full_to_swa_mapping({slots}, {values})")
    if op == "set_kv_buffer":
        loc = rng.sample([0, *live], rng.randint(0, min(len(live) + 1, ARGS)))
        layer = rng.choice([FULL_LAYER, SWA_LAYER])
        rows = [run.row() for _ in loc]
        half = CONFIG.kv.row_width
        tags = [run.tag(r) for r in rows]
        return Call(op, mutate(lambda s: sa.set_kv_buffer(s, layer, loc, [r[:half] for r in rows],
                                                          [r[half:] for r in rows])),
                    lambda a: [*_list_args(a, loc, tags), a.swa_layer == (layer == SWA_LAYER)],
                    f"set_kv_buffer(layer {layer}, {loc})")
    if op == "get_cpu_copy":
        indices = [rng.choice(live) for _ in range(rng.randint(0, ARGS))] if live else []

        def take_copy(r: Run) -> None:
            r.copy = sa.get_cpu_copy(r.state, indices)
        return Call(op, take_copy, lambda a: _list_args(a, indices), f"get_cpu_copy({indices})")
    if op == "load_cpu_copy":
        copy = run.copy
        assert copy is not None
        n = len(copy.swa_mask)
        indices = rng.sample(live, n) if n <= len(live) else [*live, 0]  # too few live slots: the reference rejects
        return Call(op, mutate(lambda s: sa.load_cpu_copy(s, copy, indices)), lambda a: _list_args(a, indices),
                    f"load_cpu_copy({indices})")
    loc = [rng.randrange(-1, (len(PAGES) + 1) * P) for _ in range(rng.randint(0, 3))]
    result = list(sa.translate_loc_from_full_to_swa(run.state, loc))
    return Call(op, lambda r: None, lambda a: _list_args(a, loc, result=result),
                f"translate_loc_from_full_to_swa({loc}) -> {result}")


@dataclass(frozen=True)
class Pair:
    """One successful reference step, encoded for the model."""

    op: str
    text: str
    pre: Callable[[State], Facts]
    post: Callable[[State], Facts]
    args: Callable[[Action], Facts]


def sampled_pairs(seed: int, steps: int = STEPS) -> list[Pair]:
    run, pairs = Run(random.Random(seed)), []
    for _ in range(steps):
        call = sample(run)
        pre = encode_state(run, run.state, run.backup, run.copy)
        try:
            call.apply(run)
        except (InvalidOperation, OutOfMemory):
            continue
        post = encode_state(run, run.state, run.backup, run.copy)
        pairs.append(Pair(call.op, call.text, pre, post, call.args))
    return pairs


@functools.cache
def all_pairs() -> tuple[Pair, ...]:
    return tuple(pair for seed in SEEDS for pair in sampled_pairs(seed))


def test_sampled_runs_exercise_every_transition() -> None:
    counts = Counter(pair.op for pair in all_pairs())
    assert set(counts) == set(swa_s3.SYSTEM.ops), f"never sampled successfully: {set(swa_s3.SYSTEM.ops) - set(counts)}"


@pytest.mark.parametrize("seed", SEEDS)
def test_every_transition_accepts_the_reference_steps(seed: int) -> None:
    for i, pair in enumerate(sampled_pairs(seed)):
        verdict = _ts.accepts(swa_s3.SYSTEM, pair.op, pair.pre, pair.post, pair.args)
        assert verdict.accepted, f"seed {seed}, step {i}: {pair.text}: {verdict}"


#: Deliberately wrong transitions (the twins' broken ops): each must reject some sampled step of its op.
WRONG = {
    "free_swa": Variant(free_swa_clears=False),
    "alloc": Variant(alloc_writes_mapping=False),
    "free": Variant(free_releases_swa=False),
    "clear": Variant(clear_swa_pool=False),
}


@pytest.mark.parametrize("op", sorted(WRONG))
def test_a_wrong_transition_rejects_some_reference_step(op: str) -> None:
    wrong = swa_s3.SYSTEM.with_transitions(**{op: swa_s3.system(WRONG[op]).transitions[op]})
    verdicts = [_ts.accepts(wrong, op, p.pre, p.post, p.args) for p in all_pairs() if p.op == op]
    assert verdicts, f"no sampled {op} step"
    rejected = [v for v in verdicts if not v.accepted]
    assert rejected, f"the broken {op} accepts all {len(verdicts)} sampled steps: the drift test cannot fail"
    assert rejected[0].status == "rejected" and rejected[0].conflict, str(rejected[0])

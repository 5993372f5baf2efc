"""Every mutant in ``kvproof.conformance.mutants.swa_allocator`` differs from the correct runtime somewhere.

For each mutant a short hand-written op sequence (the hint in its docstring) runs on
the mutant and on the correct ``SWATokenToKVPoolAllocator``; the traces (results or
raised errors, snapshots, KV buffers after every step) must differ. Whether the
lockstep suite *catches* them is the harness author's test, against ``MUTANTS``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvproof.conformance.mutants.swa_allocator import MUTANTS
from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference import PoolConfig

Step = Callable[[SWATokenToKVPoolAllocator, dict[str, Any]], Any]


def t(values: Any, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def ext(pre: int, seq: int, last: int) -> Step:
    return lambda a, m: a.alloc_extend(t([pre], a.device), t([pre], torch.device("cpu")), t([seq], a.device),
                                       t([seq], torch.device("cpu")), t([last], a.device), seq - pre)


def tail(seq: int, n: int) -> Step:
    cpu = torch.device("cpu")
    return lambda a, m: a.alloc_extend_swa_tail(t([0], a.device), t([0], cpu), t([seq], a.device), t([seq], cpu),
                                                t([-1], a.device), seq, n)


def decode(seq: int, last: int) -> Step:
    return lambda a, m: a.alloc_decode(t([seq], a.device), t([seq], torch.device("cpu")), t([last], a.device))


def call(method: str, slots: list[int]) -> Step:
    return lambda a, m: getattr(a, method)(t(slots, a.device))


def segment(method: str, slots: list[int], start_pos: int) -> Step:
    return lambda a, m: getattr(a, method)(t(slots, a.device), start_pos=start_pos)


def backup() -> Step:
    return lambda a, m: m.__setitem__("backup", a.backup_state())


def restore() -> Step:
    return lambda a, m: a.restore_state(m["backup"])


def copy_of(slots: list[int]) -> Step:
    return lambda a, m: m.__setitem__("copy", a.get_cpu_copy(t(slots, a.device)))


def load_into(slots: list[int]) -> Step:
    return lambda a, m: a.load_cpu_copy(m["copy"], t(slots, a.device))


def set_kv(layer: int, slots: list[int]) -> Step:
    def step(a: SWATokenToKVPoolAllocator, m: dict[str, Any]) -> None:
        k = torch.arange(len(slots) * 2, dtype=torch.float32).reshape(len(slots), 1, 2) + 1
        a.get_kvcache().set_kv_buffer(layer, t(slots, a.device), k.to(a.device), (k + 50).to(a.device))
    return step


def cfg(p: int, full: int, swa: int) -> PoolConfig:
    return PoolConfig(size_full=full, size_swa=swa, page_size=p, sliding_window_size=4)


def ring(p: int, full: int, swa: int) -> PoolConfig:
    """A ring config: ring of 3 tokens, 4 request slots (0.5.23's per-request SWA ring)."""
    return PoolConfig(size_full=full, size_swa=swa, page_size=p, sliding_window_size=4, swa_ring_size=3,
                      num_req_slots=4)


S4 = [lambda a, m: a.alloc(8), tail(6, 4), set_kv(0, list(range(9, 15))), copy_of(list(range(9, 15))),
      call("free", list(range(9, 15))), lambda a, m: a.alloc(8), tail(6, 2), load_into(list(range(23, 29)))]

SCRIPTS: dict[str, tuple[PoolConfig, list[Step]]] = {
    "leak_on_failed_alloc": (cfg(4, 32, 8), [ext(0, 12, -1)]),
    "wrong_page_rounding": (cfg(4, 32, 32), [ext(0, 6, -1)]),
    "free_swa_keeps_mapping": (cfg(4, 32, 32), [ext(0, 4, -1), call("free_swa", [4])]),
    "nonatomic_alloc_decode": (cfg(4, 32, 4), [decode(1, -1), decode(1, -1)]),
    "mask_asymmetry": (cfg(1, 32, 32), S4),
    "tail_start_off_by_one": (cfg(4, 32, 32), [tail(8, 4)]),
    "double_free_accepted": (cfg(4, 32, 32), [ext(0, 4, -1), call("free", [4]), call("free", [4])]),
    "slot_zero_handed_out": (cfg(4, 32, 32), [ext(0, 4, -1)]),
    "stale_tail_mapping": (cfg(2, 6, 6), [backup(), ext(0, 2, -1), restore(), tail(4, 2)]),
    "swa_last_loc_untranslated": (cfg(2, 12, 12), [ext(0, 2, -1), call("free_swa", [2]), ext(0, 1, -1), ext(1, 2, 4)]),
    "restore_forgets_swa": (cfg(4, 32, 32), [backup(), ext(0, 4, -1), restore()]),
    "free_order_append": (cfg(4, 32, 32), [ext(0, 8, -1), call("free", [4])]),
    "free_full_unchecked": (cfg(4, 32, 32), [ext(0, 4, -1), call("free_full", [4])]),
    "clear_drops_sentinel": (cfg(4, 32, 32), [lambda a, m: a.translate_loc_from_full_to_swa(t([-1], a.device))]),
    "group_ignored": (cfg(4, 32, 32), [ext(0, 4, -1), lambda a, m: a.free_group_begin(), call("free", [4, 5, 6, 7])]),
    "group_end_in_call_order": (cfg(4, 32, 32), [ext(0, 4, -1), ext(0, 4, -1), lambda a, m: a.free_group_begin(),
                                                 call("free", [8, 9, 10, 11]), call("free", [4, 5, 6, 7]),
                                                 lambda a, m: a.free_group_end()]),
    "group_mapping_kept_to_end": (cfg(4, 32, 32), [ext(0, 4, -1), lambda a, m: a.free_group_begin(),
                                                   call("free_swa", [4])]),
    "segment_sorts_pages": (cfg(4, 32, 32), [ext(0, 4, -1), ext(0, 4, -1), ext(0, 4, -1), call("free", [4, 5, 6, 7]),
                                             call("free", [12, 13, 14, 15]), ext(0, 8, -1),
                                             segment("free_segment", [12, 13, 14, 15, 4, 5, 6, 7], 0)]),
    "segment_peer_unchecked": (cfg(4, 32, 32), [ext(0, 4, -1), call("free_swa", [4, 5, 6, 7]),
                                                segment("free_segment", [4, 5, 6, 7], 0)]),
    "ring_available_takes_min": (ring(2, 24, 12), [lambda a, m: a.alloc_req_slots(1)]),
    "ring_extend_gated_by_swa_pool": (ring(2, 24, 4), [ext(0, 6, -1)]),
    "ring_alloc_takes_swa": (ring(2, 24, 12), [lambda a, m: a.alloc(2)]),
}


def trace(factory: Callable[[PoolConfig], SWATokenToKVPoolAllocator], config: PoolConfig,
          steps: list[Step]) -> list[Any]:
    """Outcome, snapshot and KV buffers after construction and after every step."""
    a, memo = factory(config), dict[str, Any]()
    out: list[Any] = [a.snapshot()]
    for step in steps:
        try:
            r = step(a, memo)
            outcome: Any = ("ok", r.tolist() if isinstance(r, torch.Tensor) else None)
        except Exception as e:  # noqa: BLE001 -- a mutant may crash where the runtime raises or succeeds
            outcome = ("raised", type(e).__name__, getattr(e, "op", None), getattr(e, "argument", None))
        kv = a.get_kvcache()
        sizes = (a.available_size(), a.full_available_size(), a.swa_available_size())
        out.append((outcome, a.snapshot(), sizes, kv.full_kv.cpu().tolist(), kv.swa_kv.cpu().tolist()))
    return out


def test_every_mutant_has_a_script() -> None:
    assert set(SCRIPTS) == set(MUTANTS)
    assert len(MUTANTS) >= 10


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_mutant_differs_from_runtime(name: str) -> None:
    config, steps = SCRIPTS[name]
    correct = trace(SWATokenToKVPoolAllocator, config, steps)
    assert all(step[0][0] == "ok" or step[0][1] in ("InvalidOperation", "OutOfMemory") for step in correct[1:])
    assert trace(MUTANTS[name], config, steps) != correct, f"{name} behaves like the correct runtime"


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_documents_its_bug(name: str) -> None:
    doc = MUTANTS[name].__doc__ or ""
    assert re.search(r"\b(G[1-5]|M[1-5]|D3|SR[1-3])\b|EXACT_PAGE_ORDER", doc), f"{name} docstring names no invariant"
    assert "Differs:" in doc, f"{name} docstring gives no differing op sequence"

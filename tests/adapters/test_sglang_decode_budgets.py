"""SGLang 0.5.23's decode preallocation queue's admission decisions on the real allocator (capability
``DECODE_BUDGETS``, docs/sglang-findings.md, "The decode preallocation queue's own budget functions"): the
reservation test (``_prealloc_reservation_fits`` / ``prealloc_fits``) and the SWA reclaim
(``_reclaim_swa_tail_capacity`` / ``SWATokenToKVPoolAllocator.reclaim_for_prealloc``) against the reference's
gates and ``reclaim_swa_tail``, and the lockstep check that compares them failing when the engine's answer is wrong.

The lockstep pass itself (every P > 1 config, these decisions included) is
``tests/adapters/test_sglang.py::test_the_decode_queues_budget_functions_agree_with_the_reference_in_lockstep``.
Tests that need SGLang are skipped with one reason, naming the install command, when it is not importable.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvproof.conformance.adapters import sglang as adapter
from kvproof.conformance.check import run_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.reference import decode_prealloc as dp
from kvproof.reference import swa_allocator as sa

SKIP_REASON = f"SGLang is not installed here; install it with: {adapter.INSTALL_HINT}"
needs_sglang = pytest.mark.skipif(not adapter.sglang_available(), reason=SKIP_REASON)
PAGED = [c for c in CONFORMANCE_CONFIGS if c.page_size > 1]


def _node_class() -> Any:
    from kvproof.conformance.adapters.sglang_decode_budgets import SGLangDecodeNode

    return SGLangDecodeNode


def _queued(out: dict[str, Any], n_queued: int) -> list[dict[str, Any]]:
    return list(out["requests"])[-n_queued:] if n_queued else []


@needs_sglang
@pytest.mark.parametrize("config", PAGED[:2], ids=lambda c: c.label())
def test_the_real_reclaim_asks_the_tree_and_answers_as_the_reference(config) -> None:
    """On an empty node and after filling most of the SWA pool: 0.5.23's reclaim for a queued request is ready when
    its page-rounded tail fits the free SWA tokens, else asks the stand-in tree to evict the difference (it evicts
    nothing) and reports the shortfall; each answer is the reference's ``reclaim_swa_tail``."""
    impl = _node_class()(config)
    p, w = config.page_size, config.sliding_window_size
    decode = dp.DecodeConfig(reserved_decode_tokens=0, policy=dp.PreallocPolicy.CORRECTED, write_kv=False)
    node, state = dp.initial_node(decode), sa.initial_state(config)
    shapes = [(1, 1, 2), (w + p + 1, 1, 4), (config.size_swa, 1, 2)]
    for rid, (origin, out, max_new) in enumerate(shapes, start=1):
        node = dp.arrive(node, rid, origin, out, max_new)

    def ask() -> list[dict[str, Any]]:
        got = impl.decode_budgets([], [], list(shapes), reserved_decode_tokens=0, sliding_window_size=w)
        return _queued(got, len(shapes))

    # fill the SWA pool but for one page, on both sides (a request of size_swa - P tokens, all of them in the tail)
    fill = config.size_swa - p
    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    impl.alloc_extend_swa_tail(t([0]), t([0]), t([fill]), t([fill]), t([-1]), fill, fill)
    state, _ = sa.alloc_extend_swa_tail(state, [0], [fill], [-1], fill, fill)
    before = impl.tree_cache.evictions
    answers = ask()
    for req, got in zip(node.queue, answers, strict=True):
        want = dp.reclaim_swa_tail(node, state, req)
        assert got["reclaim_called"] is dp.admission_reclaims_swa(node, state) is True
        mine = None if want.ready else (want.needed, want.available)
        theirs = None if got["reclaim"] is None else (got["reclaim"]["needed"], got["reclaim"]["available"])
        assert theirs == mine, (req, got)
    short = [a for a in answers if a["reclaim"] is not None]
    assert short and all(a["reclaim"]["available"] == p for a in short), answers  # one page left
    assert impl.tree_cache.evictions - before == len(short)  # a shortfall asked the tree first, and only then
    last = short[-1]["reclaim"]
    assert impl.tree_cache.last_asked.swa_num_tokens == last["needed"] - last["available"]
    assert "SWA eviction insufficient" in last["message"]
    assert answers[0]["reclaim"] is None  # a one-token request fits the last page


@needs_sglang
@pytest.mark.parametrize(("perturbation", "check"), [("reclaim", "reclaim"), ("reservation", "reservation"),
                                                     ("resume", "reservation")])
def test_a_wrong_admission_decision_is_caught_in_lockstep(sglang_modules_loaded, perturbation: str,
                                                          check: str) -> None:
    """Test the tester: an engine whose reclaim always says ready (it ignores a shortfall), whose reservation test
    admits every queued request, or refuses every retracted one, is a verdict of ``decode_budgets_agree`` naming the
    check; the unperturbed engine passes the same config (the full pass: test_sglang.py)."""
    base = _node_class()

    class Wrong(base):
        def decode_budgets(self, running, retracted, queued, **kwargs):
            out = super().decode_budgets(running, retracted, queued, **kwargs)
            n_run, n_ret = len(running), len(retracted)
            for i, entry in enumerate(out["requests"]):
                queued_entry, retracted_entry = i >= n_run + n_ret, n_run <= i < n_run + n_ret
                if perturbation == "reclaim" and queued_entry:
                    entry["reclaim"] = None
                elif perturbation == "reservation" and queued_entry:
                    entry["reservation_fits"] = True
                elif perturbation == "resume" and retracted_entry:
                    entry["reservation_fits"] = False
            return out

    config = PAGED[0]
    broken = run_check("decode_prealloc", Wrong, config, failures_dir=None, isolation="in-process", accept=("F1",))
    assert not broken.passed and broken.evidence is not None, broken.failure
    assert broken.evidence["check"] == check, broken.failure
    round_op = "resume_retracted_reqs" if perturbation == "resume" else "pop_preallocated"
    assert broken.evidence["detail"]["round"] == round_op, broken.evidence
    assert f"in {round_op}, " in (broken.failure or "")


@pytest.fixture(scope="module")
def sglang_modules_loaded() -> adapter.SGLangModules:
    return adapter.load_sglang()


@needs_sglang
def test_a_wrong_reclaim_inside_an_admission_round_is_caught(sglang_modules_loaded) -> None:
    """The in-round comparison fails too: an engine whose reclaim says short only for a request asked about on its
    own, with pages taken and nothing running (the question ``_reclaim_in_round`` asks before the second admission of
    a round on an idle node), is a verdict naming the moment, before that request's preallocation."""
    base = _node_class()

    class ShortMidRound(base):
        def decode_budgets(self, running, retracted, queued, **kwargs):
            out = super().decode_budgets(running, retracted, queued, **kwargs)
            mid_round = not running and not retracted and len(queued) == 1 \
                and self.allocator.full_available_size() < self.allocator.size_full
            if mid_round:
                out["requests"][0]["reclaim"] = {"needed": 10**6, "available": 0, "message": "perturbed"}
            return out

    broken = run_check("decode_prealloc", ShortMidRound, PAGED[0], failures_dir=None, isolation="in-process",
                       accept=("F1",))
    assert not broken.passed and broken.evidence is not None, broken.failure
    assert broken.evidence["check"] == "reclaim" and broken.evidence["ops"][-1] == "pop_preallocated", \
        broken.evidence
    assert "in pop_preallocated, before its preallocation" in (broken.failure or ""), broken.failure

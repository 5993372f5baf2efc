"""The SGLang 0.5.23 adapter: importable without SGLang, and, where SGLang is installed
(``.venv-sglang``: ``make sglang``), the real allocator behind the protocol, its lockstep
runs, and one test per documented finding (docs/sglang-findings.md).

Tests that need SGLang are skipped with one reason, naming the install command, when it
is not importable (the main ``.venv`` has no SGLang on purpose).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from hypothesis import settings

from kvproof.conformance.adapters import install_sglang, sglang_findings
from kvproof.conformance.adapters import sglang as adapter
from kvproof.conformance.check import run_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS, RING_CONFIGS, RING_P1_CONFIG
from kvproof.conformance.errors import UsageError
from kvproof.conformance.profiles import get_profile
from kvproof.reference.contract import Capability, SWAAllocatorUnderTest

SKIP_REASON = f"SGLang is not installed here; install it with: {adapter.INSTALL_HINT}"
needs_sglang = pytest.mark.skipif(not adapter.sglang_available(), reason=SKIP_REASON)
C = Capability


# ---------------------------------------------------------------- without SGLang (any venv)


def test_importing_the_adapter_does_not_import_sglang() -> None:
    code = ("import sys, kvproof.conformance.adapters.sglang as a, kvproof.conformance.adapters.sglang_findings, "
            "kvproof.conformance.adapters.bench_sglang; "
            "assert 'sglang' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_constructing_without_sglang_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "_LOADED", None)
    monkeypatch.setattr(adapter, "sglang_available", lambda: False)
    with pytest.raises(ImportError, match=r"install_sglang") as err:
        adapter.SGLangSWAAllocator(CONFORMANCE_CONFIGS[0])
    assert "make sglang" in str(err.value)


def test_cpu_engine_env_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "_LOADED", None)
    monkeypatch.setattr(adapter, "sglang_available", lambda: True)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    with pytest.raises(UsageError, match="SGLANG_USE_CPU_ENGINE"):
        adapter.load_sglang()


def test_stubs_import_and_refuse_to_run_kernels() -> None:
    """The stand-ins alone (no SGLang needed): the names read at import exist; running a kernel raises."""
    code = f"""
import sys
sys.path.insert(0, {str(adapter.STUBS_DIR)!r})
import triton, triton.language as tl
from triton.runtime.jit import JITFunction, KernelInterface
from triton.runtime.autotuner import OutOfResources, Autotuner, Heuristics
from triton.runtime.cache import triton_key
from triton.language.extra import libdevice
from triton.compiler import CompiledKernel
import triton.backends.compiler, triton.compiler.compiler
import torchvision, torchvision.transforms as T
from torchvision.transforms.functional import InterpolationMode, pil_to_tensor
from torchvision.io import ImageReadMode, decode_image
assert triton.__version__ == torchvision.__version__ == "0.0.0+kvproof.stub"
assert T.InterpolationMode.NEAREST_EXACT is InterpolationMode.NEAREST_EXACT

@triton.jit
def kernel(x, BLOCK: tl.constexpr):
    pass

for call in (lambda: kernel[(1,)](0, 1), lambda: pil_to_tensor(None)):
    try:
        call()
    except RuntimeError as err:
        assert "kvproof" in str(err)
    else:
        raise AssertionError("a stub ran")
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_installer_names_forbidden_distributions() -> None:
    assert install_sglang.forbidden(["torch", "triton", "nvidia_cudnn_cu12", "NVIDIA-nccl-cu12", "numpy",
                                     "pytorch-triton"]) == ["NVIDIA-nccl-cu12", "nvidia_cudnn_cu12", "pytorch-triton",
                                                            "triton"]
    assert install_sglang.default_requirements().is_file()


def test_installer_refuses_a_missing_venv(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert install_sglang.main(["--venv", str(tmp_path / "nowhere")]) == 1
    assert "not a venv" in capsys.readouterr().err


def test_requirements_never_name_cuda_packages() -> None:
    names = [line.split("==")[0].strip() for line in install_sglang.default_requirements().read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert names and not install_sglang.forbidden(names) and "torch" not in names
    assert all("==" in line for line in install_sglang.default_requirements().read_text().splitlines()
               if line.strip() and not line.startswith("#")), "every requirement is pinned"


def test_capabilities_follow_sglang_0_5_23() -> None:
    p1, p4 = adapter.capabilities_for(1), adapter.capabilities_for(4)
    assert C.ALLOC in p1 and not {C.ALLOC_EXTEND, C.ALLOC_DECODE, C.ALLOC_EXTEND_SWA_TAIL} & p1
    assert {C.ALLOC_EXTEND, C.ALLOC_DECODE, C.ALLOC_EXTEND_SWA_TAIL} <= p4 and C.ALLOC not in p4
    for caps in (p1, p4):
        assert C.FREE_FULL in caps and C.EXACT_PAGE_ORDER in caps
        assert not {C.BACKUP_RESTORE, C.REJECTS_MISUSE, C.GRAPH_CAPTURE} & caps


def test_classify_names_each_finding_by_what_happened() -> None:
    """F1 and F2 are recognised by the evidence (the operation, the check, what changed), not by the headline: an
    alloc_extend that keeps pages prints F1's headline and is not F1."""
    from kvproof.conformance.findings import Evidence

    kept = {"full_pages_taken": [5], "full_pages_given": [], "swa_pages_taken": [], "swa_pages_given": [],
            "mapping_entries_changed": 0}
    f1 = Evidence("swa_allocator", "alloc_decode", "unchanged_on_failure", 9, detail=kept)
    f2 = Evidence("swa_allocator", "free", "state", 4, detail={"code": "free_count", "pool": "swa",
                                                                "reserved_page_free": True})
    assert sglang_findings.classify(f1).id == "F1" and sglang_findings.classify(f1.to_json()).id == "F1"
    assert sglang_findings.classify(f2).id == "F2"
    assert sglang_findings.classify(Evidence("swa_allocator", "alloc_extend", "unchanged_on_failure", 9,
                                             detail=kept)) is None
    assert sglang_findings.classify(Evidence("swa_allocator", "free", "state", 4, detail={"code": "stale_mapping"}))\
        is None
    assert adapter.SGLangSWAAllocator.findings == sglang_findings.FINDINGS  # declared by the adapter


# ---------------------------------------------------------------- with SGLang


@pytest.fixture(scope="module")
def sglang_modules() -> adapter.SGLangModules:
    return adapter.load_sglang()


@needs_sglang
@pytest.mark.parametrize("config", CONFORMANCE_CONFIGS, ids=lambda c: c.label())
def test_adapter_builds_the_real_pool_and_meets_the_protocol(sglang_modules, config) -> None:
    impl = adapter.SGLangSWAAllocator(config)
    assert isinstance(impl, SWAAllocatorUnderTest)
    assert type(impl.allocator).__module__ == "sglang.srt.mem_cache.allocator.swa"
    assert impl.kvcache is impl.allocator.get_kvcache()
    assert impl.capabilities == adapter.capabilities_for(config.page_size)
    snap = impl.snapshot()
    assert snap.full.free_pages == tuple(range(1, config.num_pages_full + 1))
    assert snap.swa.free_pages == tuple(range(1, config.num_pages_swa + 1))
    assert snap.full_to_swa_index_mapping == (0,) * (config.mapping_len - 1) + (-1,)
    assert impl.available_size() == config.size_swa
    k, _ = impl.get_kvcache().get_kv_buffer(config.kv.swa_attention_layer_ids[0])
    assert k.shape == (config.size_swa + config.page_size, config.kv.head_num, config.kv.head_dim)
    # SGLang's paged pools take their torch fallback on the base platform, never a (stubbed) Triton kernel
    assert config.page_size == 1 or impl.allocator.full_attn_allocator.use_triton_kernels is False


@needs_sglang
def test_stubs_are_declared_not_sniffed(sglang_modules) -> None:
    import importlib.util

    for name in adapter.STUBBABLE:
        real = name not in sglang_modules.stubs
        spec = importlib.util.find_spec(name)
        assert spec is not None and (str(adapter.STUBS_DIR) in (spec.origin or "")) != real


@needs_sglang
def test_out_of_memory_is_raised_not_returned(sglang_modules) -> None:
    import torch

    from kvproof.reference.errors import OutOfMemory

    impl = adapter.SGLangSWAAllocator(CONFORMANCE_CONFIGS[0])  # P1, SWA pool of 8
    before = impl.snapshot()
    with pytest.raises(OutOfMemory, match="swa pool"):
        impl.alloc(9)
    assert impl.snapshot() == before
    slots = impl.alloc(3)
    assert slots.dtype == torch.int64 and impl.translate_loc_from_full_to_swa(slots).tolist() == slots.tolist()


@needs_sglang
@pytest.mark.parametrize("config", CONFORMANCE_CONFIGS, ids=lambda c: c.label())
def test_lockstep_divergences_are_the_documented_findings(sglang_modules, config) -> None:
    """A short ``ci`` lockstep run per config: it passes, or stops on a finding of docs/sglang-findings.md.

    0.5.23: at P == 1 it passes (F2 is a declared difference: no ``FREE_RELEASED_SWA``,
    so the harness frees such requests with ``free_swa`` + ``free_full``); at P > 1 it
    stops on F1, on the ``alloc_decode`` that shows it.
    """
    one_bug = settings(get_profile("ci"), report_multiple_bugs=False)
    report = run_check("swa_allocator", adapter.SGLangSWAAllocator, config, settings=one_bug, failures_dir=None)
    assert report.steps > 0
    if config.page_size == 1:
        assert report.passed, report.failure
        assert report.calls.get("free_full", 0) > 0  # the split release ran
        return
    assert not report.passed
    finding = sglang_findings.classify(report.evidence)
    assert finding is not None, f"an undocumented divergence:\n{report.failure[:3000]}"
    assert finding.id == "F1" and report.finding == "F1", report.failure[:3000]
    trace = report.failure.split("operations so far:")[1].split("\n\n")[0].strip().splitlines()
    assert re.fullmatch(r"\d+\. alloc_decode\(.*\) -> OutOfMemory", trace[-1].strip()), trace


@needs_sglang
@pytest.mark.parametrize("component", ["swa_allocator", "loc_cache", "decode_prealloc"])
def test_looking_past_f1_every_page_size_runs_its_whole_budget(sglang_modules, component: str) -> None:
    """``--accept F1``: the suite follows 0.5.23's non-atomic alloc_decode on the reference at every occurrence, so
    every config passes its whole ``ci`` budget (F1 counted at every P > 1; P == 1 has no alloc_decode). At P == 1
    the allocator has no alloc_extend either, through which decode_prealloc admits every request: that run never
    calls it, so it checks nothing (``CheckReport.checked_nothing``: conform and fuzz report it as skipped)."""
    seen, checked_nothing = {}, {}
    for config in CONFORMANCE_CONFIGS:
        report = run_check(component, adapter.SGLangSWAAllocator, config, profile="ci", failures_dir=None,
                           accept=("F1",))
        assert report.passed, report.failure
        seen[config.label()], checked_nothing[config.label()] = report.accepted["F1"], report.checked_nothing
    assert seen["P1-W3-F12-S8"] == 0 and sum(seen.values()) > 0, seen
    assert {label for label, nothing in checked_nothing.items() if nothing} == (
        {"P1-W3-F12-S8"} if component == "decode_prealloc" else set()), checked_nothing
    if component != "decode_prealloc":  # the allocator rules decode into a short SWA pool at every P > 1
        assert all(n > 0 for label, n in seen.items() if not label.startswith("P1-")), seen


class _MergeDropsAPage(adapter.SGLangSWAAllocatorSorted):
    """Test the tester: a need_sort merge that loses one staged page of the full pool (a real merge bug's shape)."""

    def __init__(self, config, device="cpu"):
        super().__init__(config, device)
        pool = self.allocator.full_attn_allocator
        merge = pool.merge_and_sort_free

        def lossy() -> None:
            staged = pool.staged_pages if self.page_size > 1 else pool.release_pages
            if len(staged) and (self.page_size == 1 or sum(len(x) for x in staged)):
                if self.page_size > 1:
                    pool.staged_pages = [torch.cat(list(staged))[1:]]
                    pool.num_staged_pages -= 1
                else:
                    pool.release_pages = staged[1:]
            merge()

        pool.merge_and_sort_free = lossy


@needs_sglang
def test_need_sort_stages_frees_and_merges_them_sorted_when_the_free_list_runs_short(sglang_modules) -> None:
    """The production variant really stages: frees wait in staged_pages (counted as available, not handed out), and an
    allocation that finds the free list short merges them, sorted."""
    from kvproof.reference.config import PoolConfig

    a = adapter.SGLangSWAAllocatorSorted(PoolConfig(size_full=16, size_swa=8, page_size=2, sliding_window_size=3))
    assert C.EXACT_PAGE_ORDER not in a.capabilities and a.allocator.full_attn_allocator.need_sort
    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    loc = a.alloc_extend(t(0), t(0), t(6), t(6), t(-1), 6)  # full pages 1-3 of 8, SWA 1-3 of 4
    a.free(loc)
    full = a.allocator.full_attn_allocator
    assert sorted(int(x) for x in torch.cat(full.staged_pages).tolist()) == [1, 2, 3]
    assert full.free_pages.tolist() == [4, 5, 6, 7, 8] and a.allocator.full_available_size() == 16
    assert sorted(a.snapshot().full.free_pages) == list(range(1, 9))  # the snapshot sees the staged pages
    a.alloc_extend(t(0), t(0), t(8), t(8), t(-1), 8)  # bound 8 // 2 + 1 + 1 = 6 > 5 free: merge, sorted, then take
    assert full.staged_pages == [] and full.free_pages.tolist() == [5, 6, 7, 8]


@needs_sglang
def test_need_sort_variant_runs_past_f1_and_its_merges_are_checked(sglang_modules) -> None:
    """need_sort=True (disaggregated servers) on every config, past F1; a merge that loses a staged page is caught.
    (``kvproof conform --impl ...:SGLangSWAAllocatorSorted`` runs loc_cache and decode_prealloc on it too.)"""
    component = "swa_allocator"
    for config in CONFORMANCE_CONFIGS:
        report = run_check(component, adapter.SGLangSWAAllocatorSorted, config, profile="ci", failures_dir=None,
                           accept=("F1",))
        assert report.passed, report.failure
    caught = [run_check(component, _MergeDropsAPage, config, profile="ci", failures_dir=None, accept=("F1",),
                        shrink_with="vector")  # caught, and which finding: not how short (the faster shrinker)
              for config in CONFORMANCE_CONFIGS[:2]]
    assert all(not r.passed for r in caught), [r.failure for r in caught]
    assert all(r.finding == "new" for r in caught), [r.finding for r in caught]


@needs_sglang
def test_f1_alloc_decode_leaks_full_pages(sglang_modules) -> None:
    seen = sglang_findings.reproduce_alloc_decode_leak()
    assert seen["result"] is None and seen["before"] == (8, 0)
    assert seen["after"] == (4, 0), "SGLang now rolls back alloc_decode: update docs/sglang-findings.md F1"
    assert seen["full_free_after_release"] == seen["size_full"] - 4  # the page is lost for good


@needs_sglang
def test_f1_mirror_a_short_full_pool_leaks_the_swa_page_and_the_reference_follows_it(sglang_modules) -> None:
    """The leak the suites look past (--accept F1) in its other shape, on SGLang and on the reference's follower."""
    from kvproof.reference import swa_allocator as ref
    from kvproof.reference.config import PoolConfig
    from kvproof.reference.paged import LEAKED

    seen = sglang_findings.reproduce_alloc_decode_leak_mirror()
    assert seen["result"] is None and seen["before"] == (0, 4)
    assert seen["after"] == (0, 0), "SGLang no longer takes SWA pages when the full pool is short: update F1"
    s = ref.initial_state(PoolConfig(size_full=16, size_swa=8, page_size=4, sliding_window_size=3))
    s, first = ref.alloc_extend(s, [0], [8], [-1], 8, owners=[1])
    s = ref.free_swa(s, list(first[:4]))
    for rid in (2, 3):
        s, slots = ref.alloc_extend(s, [0], [4], [-1], 4, owners=[rid])
        s = ref.free_swa(s, list(slots))
    assert (ref.full_available_size(s), ref.swa_available_size(s)) == seen["before"]
    leaked = ref.leak_failed_alloc_decode(s, [9], [first[-1]])
    assert (ref.full_available_size(leaked), ref.swa_available_size(leaked)) == seen["after"]
    assert leaked.swa.owner.count(LEAKED) == 1 and leaked.full.owner.count(LEAKED) == 0


@needs_sglang
def test_f2_p1_free_after_free_swa_hands_out_slot_0(sglang_modules) -> None:
    seen = sglang_findings.reproduce_p1_free_released_swa()
    assert 0 in seen["swa_free_pages"], "SGLang now filters released peers at P == 1: update F2"
    assert seen["c_swa_slots"][-1] == 0  # a live, in-window token of request C maps to the padding slot


@needs_sglang
def test_side_by_side_benchmark_runs(sglang_modules) -> None:
    from kvproof.conformance.adapters.bench_sglang import side_by_side

    rows = side_by_side(page_sizes=(1, 4), ops=200, repeat=1)
    assert [r["page_size"] for r in rows] == [1, 4]
    assert all(r["kvproof_ops_per_s"] > 0 and r["sglang_ops_per_s"] > 0 and r["ratio"] > 0 for r in rows)


# ---------------------------------------------------------------- the harm of each finding (kvproof.conformance.harm)


@needs_sglang
def test_f1_continued_on_sglang_alone_loses_capacity(sglang_modules) -> None:
    """F1's shrunk trace (kept as a vector), continued on SGLang alone: every request freed, the leaked full page is
    neither free nor held (docs/sglang-findings.md, "The harm of each finding")."""
    from pathlib import Path

    from kvproof.conformance.harm import continue_for_harm
    from kvproof.conformance.vector import load_vector
    from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator

    vector = load_vector(Path(__file__).with_name("vectors") / "f1_alloc_decode_leak_P2.json")
    found = continue_for_harm(vector, adapter.SGLangSWAAllocator, impl_name=vector["impl"], tries=4)
    assert found.harm is not None and found.harm.kind == "capacity lost", found.text()
    assert "full pool 11 of 12 pages free, swa pool 6 of 6 pages free: 1 page(s) neither free nor held" \
        in found.harm.text, found.text()
    assert found.walk[-1].endswith("-> ok")  # the largest request is still admitted: the slack is what is lost
    fixed = continue_for_harm(vector, SWATokenToKVPoolAllocator, impl_name="runtime", tries=1)
    assert fixed.harm is None and "does not fail" in fixed.note


class _P1FreeAtItsWord(adapter.SGLangSWAAllocator):
    """SGLang at P == 1 taken at its word: ``free`` of positions whose SWA side is released (F2's call)."""

    def __init__(self, config, device: str = "cpu") -> None:
        super().__init__(config, device)
        self.capabilities = self.capabilities | {C.FREE_RELEASED_SWA}


@needs_sglang
def test_f2_continued_on_sglang_alone_puts_the_reserved_page_in_circulation(sglang_modules) -> None:
    from kvproof.conformance.harm import continue_for_harm

    p1 = next(c for c in CONFORMANCE_CONFIGS if c.page_size == 1)
    report = run_check("swa_allocator", _P1FreeAtItsWord, p1, failures_dir=None, isolation="in-process",
                       impl_name="at-its-word")
    assert report.vector is not None and report.finding == "F2", report.failure
    found = continue_for_harm(report.vector, _P1FreeAtItsWord, impl_name="at-its-word", tries=8)
    assert found.harm is not None, found.text()
    assert found.harm.kind in ("duplicate in a free list", "reserved page handed out"), found.text()
    assert "page 0" in found.harm.text or "no SWA slot" in found.harm.text, found.text()


# ---------------------------------------------------------------- free groups and kv-row segments (§1.5a)


@needs_sglang
@pytest.mark.parametrize("page_size", [1, 4])
def test_free_groups_and_segments_release_in_the_references_order(sglang_modules, page_size: int) -> None:
    """0.5.23's free group, segment calls and ``free_kv_row_segments`` (SGLang's own function) against the reference,
    snapshot by snapshot: a group holds pages back and gives them back pile by pile; segments keep their order."""
    from kvproof.reference import swa_allocator as ref
    from kvproof.reference.config import PoolConfig

    p = page_size
    config = PoolConfig(size_full=16 * p, size_swa=16 * p, page_size=p, sliding_window_size=2)
    impl, s = adapter.SGLangSWAAllocator(config), ref.initial_state(config)

    def t(values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64)

    rows = []
    for n in (p, p, 3 * p):  # requests on pages 1 | 2 | 3-5 (P == 1: slots)
        if p == 1:
            out, (s, want) = impl.alloc(n), ref.alloc(s, n)
        else:
            out = impl.alloc_extend(t([0]), t([0]), t([n]), t([n]), t([-1]), n)
            s, want = ref.alloc_extend(s, [0], [n], [-1], n)
        assert out.tolist() == list(want)
        rows.append(list(want))
    a, b, c = rows
    steps = [("free_group_begin", lambda: impl.free_group_begin(), lambda st: ref.free_group_begin(st)),
             ("free_segment", lambda: impl.free_segment(t(b), start_pos=0), lambda st: ref.free_segment(st, b, 0)),
             ("free", lambda: impl.free(t(a)), lambda st: ref.free(st, a)),
             ("free_group_end", lambda: impl.free_group_end(), lambda st: ref.free_group_end(st)),
             ("free_swa", lambda: impl.free_swa(t(c[:p])), lambda st: ref.free_swa(st, c[:p])),
             ("free_kv_row_segments",
              lambda: impl.free_kv_row_segments([(t(c[:2 * p]), 0), (t(c[2 * p:]), 2 * p)], swa_evicted_seqlen=p),
              lambda st: ref.free_kv_row_segments(st, [(c[:2 * p], 0), (c[2 * p:], 2 * p)], p))]
    for name, on_sglang, on_reference in steps:
        on_sglang()
        s = on_reference(s)
        assert impl.snapshot() == ref.snapshot(s), f"after {name}: SGLang {impl.snapshot()}, reference {s}"
    assert set(impl.snapshot().full_to_swa_index_mapping[:-1]) == {0}  # every request released


# ---------------------------------------------------------------- the decode queue's own budget functions


@needs_sglang
def test_the_decode_queues_budget_functions_agree_with_the_reference_in_lockstep(sglang_modules) -> None:
    """0.5.23's DecodePreallocQueue functions (required tokens, tail lengths, the admission round's budgets) on the
    real allocator, after every step of the decode-node simulation, equal the reference's (corrected policy: 0.5.23
    page-rounds, R4); and a budget one token off is caught (the check is not vacuous)."""
    from kvproof.conformance.adapters.sglang_decode_budgets import SGLangDecodeNode

    class OneTokenOff(SGLangDecodeNode):
        def decode_budgets(self, running, retracted, queued, **kwargs):
            out = super().decode_budgets(running, retracted, queued, **kwargs)
            full, swa = out["budgets"]
            out["budgets"] = (full - 1, swa)
            return out

    for config in [c for c in CONFORMANCE_CONFIGS if c.page_size > 1][:2]:
        report = run_check("decode_prealloc", SGLangDecodeNode, config, failures_dir=None, isolation="in-process",
                           accept=("F1",))
        assert report.passed, report.failure
        assert report.steps > 500
        broken = run_check("decode_prealloc", OneTokenOff, config, failures_dir=None, isolation="in-process",
                           accept=("F1",))
        assert not broken.passed and broken.evidence is not None and broken.evidence["check"] == "budget", \
            broken.failure


# ---- the per-request SWA ring (issue 15 item 2: DeepSeek-V4's swa_req_ring_size on the real allocator)


@needs_sglang
@pytest.mark.parametrize("config", RING_CONFIGS, ids=lambda c: c.label())
def test_the_real_ring_is_built_and_conforms(sglang_modules, config) -> None:
    """The adapter builds 0.5.23's allocator in ring mode (the field set on the pool instance, a real
    ``ReqToTokenPool``) and the suite finds no divergence on the ring configs (``ci``, derandomized)."""
    impl = adapter.SGLangSWAAllocator(config)
    a = impl.allocator
    assert a.swa_req_ring and a.swa_ring_cost_tokens == config.swa_ring_cost
    assert impl.swa_available_size() == (config.num_req_slots or 0) * config.swa_ring_cost
    assert impl.available_size() == config.size_full  # SR1: full only
    report = run_check("swa_allocator", adapter.SGLangSWAAllocator, config, profile="ci", failures_dir=None)
    assert report.passed, report.failure
    assert report.steps > 1000 and report.calls["alloc_req_slots"] and report.calls["free_req_slots"]
    assert report.outcomes["OutOfMemory"]  # request slots (or full pages) ran out, on both sides alike
    # every rule declared on a ring ran (the remap is declared off it: a ring writes no mapping to re-attach)
    assert report.never_run == (), report.never_run
    assert "set_full_to_swa_mapping" not in report.calls


@needs_sglang
def test_f8_the_ring_less_alloc_is_caught_and_labelled(sglang_modules) -> None:
    """F8: on a ring at P == 1 the suite stops at the first ``alloc``: SGLang took a paged SWA slot."""
    one_bug = settings(get_profile("ci"), report_multiple_bugs=False)
    report = run_check("swa_allocator", adapter.SGLangSWAAllocator, RING_P1_CONFIG, settings=one_bug,
                       failures_dir=None)
    assert not report.passed
    assert report.finding == "F8" and sglang_findings.classify(report.evidence).id == "F8", report.failure[:3000]
    assert report.evidence["op"] == "alloc" and report.evidence["detail"]["ring"]


@needs_sglang
def test_f8_reproduction(sglang_modules) -> None:
    from kvproof.reference import swa_allocator as ref

    seen = sglang_findings.reproduce_ring_alloc_drains_paged_swa()
    assert seen["ring"] and seen["swa_available_size"] == 12  # 3 slots x ring 4: the ring's own accounting
    assert seen["mapped"] == [[1, 2], [3, 4]], "0.5.23's alloc no longer maps paged SWA slots on a ring: update F8"
    assert seen["refused_with_available"] == [12] and seen["paged_swa_free"] == 0
    assert seen["mapping_entries_left"] == 4  # free never cleared them
    # kvproof's reference: the ring's alloc takes full pages only, so the same calls all succeed
    s = ref.initial_state(RING_P1_CONFIG)
    for _ in range(3):
        s, slots = ref.alloc(s, 2)
        assert ref.translate_loc_from_full_to_swa(s, slots) == (0, 0)
        s = ref.free(s, slots)
    assert ref.available_size(s) == RING_P1_CONFIG.size_full and not any(s.full_to_swa_index_mapping[:-1])

"""Imported by :func:`kvproof.conformance.adapters.sglang_tp_prefetch.run_ranks`'s fork server: SGLang's modules
(kvproof's stand-ins first, where needed), so that every rank forked from it starts with them imported."""

from kvproof.conformance.adapters.sglang import load_sglang
from kvproof.conformance.adapters.sglang_tp_prefetch import SGLangRankWorker

__all__ = ["SGLangRankWorker"]

load_sglang()

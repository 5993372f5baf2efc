"""vLLM 0.33.0's real v1 KV cache manager behind kvproof's ``block_pool`` suite, on CPU.

``--impl kvproof.conformance.adapters.vllm_block_pool:VLLMBlockPool`` builds, for a kvproof
:class:`~kvproof.reference.block_pool.BlockPoolConfig` (B, N, W, L, T), vLLM's own
``vllm.v1.core.kv_cache_manager.KVCacheManager`` over a ``KVCacheConfig`` of ``N`` blocks (no tensors: the
manager only does bookkeeping) with

* group 0: ``KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=B, ...))``, and, when ``sliding_window`` is
  set, group 1: ``KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=B, sliding_window=W, ...))`` -- so one
  ``BlockPool`` shared by a ``FullAttentionManager`` and a ``SlidingWindowManager`` under vLLM's
  ``HybridKVCacheCoordinator`` (``UnitaryKVCacheCoordinator`` without a window);
* ``KVCacheManager(cfg, max_model_len=L, scheduler_block_size=B, hash_block_size=B, max_in_flight_tokens=T,
  enable_caching=True)``: ``T`` is ``None`` when the config leaves it unset, which vLLM turns into ``L``
  (``KVCacheManager.__init__``), the reference's default (``BlockPoolConfig.in_flight``);
* block hashes as the engine computes them (``EngineCore.__init__``): ``init_none_hash(sha256)`` once per process
  (vLLM's default ``prefix_caching_hash_algo``) and ``get_request_block_hasher(B, sha256)`` on every ``Request``.

Every call goes to vLLM. The adapter plays the scheduler's part around it (``vllm/v1/core/sched/scheduler.py``)
and translates kvproof's terms:

* a request id ``r`` is a ``vllm.v1.request.Request`` with id ``str(r)``, created on first sight with the tokens
  given as its prompt (``SamplingParams(max_tokens=L)``) and kept: later, longer ``tokens`` reach it through
  ``append_output_token_ids`` (which extends its ``block_hashes``, as the engine does with a sampled token); tokens
  that do not extend the known ones are :class:`InvalidOperation` (a request's tokens only grow);
* ``get_computed_blocks(tokens)`` asks vLLM with a lookup ``Request`` of those tokens (the protocol names no request
  there; a block hash depends on the tokens only), block ids per group (the null block is 0);
* ``allocate_slots``: like ``Scheduler.schedule`` -- for a waiting request the lookup's ``shared_prefix_boundary``
  on the request, then ``request.num_computed_tokens = num_computed_tokens`` and vLLM's ``allocate_slots(request,
  num_new_tokens, num_new_computed_tokens=hit.num_tokens, new_computed_blocks=..., full_sequence_must_fit=...)``;
  kvproof's :class:`~kvproof.reference.block_pool.Hit` becomes a ``KVCacheBlocks`` of the pool's own block objects
  through ``KVCacheManager.create_kv_cache_blocks``, so an empty hit takes vLLM's empty path
  (``empty_kv_cache_blocks``, as a lookup miss does); then ``status = RUNNING`` and ``num_computed_tokens`` moved
  past the step (``_update_after_schedule``). ``None`` becomes :class:`OutOfMemory` (the blocks vLLM's own
  ``get_num_blocks_to_allocate`` asks for, with the same arguments, vs the free count); vLLM's ``ValueError``
  "num_new_tokens must be greater than 0 ..." becomes :class:`InvalidOperation`;
* ``free(r)`` is ``KVCacheManager.free(request)`` and then, for a running request, what ``_preempt_request`` does to
  the request (``PREEMPTED``, ``num_computed_tokens = 0``, ``num_preemptions + 1``): the protocol's ``free`` serves
  both finishing and preempting, and a finished request is never admitted again, so nothing observable depends on
  the difference. An id never seen is freed as a ``Request`` never allocated (vLLM's ``pop(request_id, [])``);
* ``remove_skipped_blocks`` / ``cache_blocks`` / ``evict_blocks`` (a ``set``) / ``reset_prefix_cache`` /
  ``get_num_free_blocks``: vLLM's, straight through.

Observation (:meth:`VLLMBlockPool.snapshot`, the only reader of private fields; each is named there): the free queue
in order, the counts, every block's primary hash mapped back to the token prefix it covers (the adapter records,
for every ``Request`` it made, ``block_hashes[i] -> tokens[:(i + 1) * B]``) with the group id from the key, the
hash map in insertion order, and per request per group ``req_to_blocks`` and ``num_cached_block``.

Capabilities: ``EXACT_PAGE_ORDER`` (vLLM's free queue is the reference's, checked every step). Not
``REJECTS_MISUSE``: vLLM asserts on an out-of-range block id (``evict_blocks``) and leaves the suite's other misuse
cases unchecked (a count past the request's tokens, caching tokens not computed yet, a count past what was
computed), so the suite reports them not applicable.

vLLM's own log lines for a refused or done ``reset_prefix_cache`` (the return value says it) are filtered out.

Importing this module never imports vLLM (the main ``.venv`` has none); the first construction does
(:func:`load_vllm`, ~5 s once per process) and raises ``ImportError`` naming what to install without it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvproof.conformance.errors import HarnessBug
from kvproof.reference.block_pool import BlockKey, BlockPoolConfig, BlockPoolSnapshot, Hit
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.reference.registry import Component

__all__ = ["CAPABILITIES", "INSTALL_HINT", "VLLM_VERSION", "VLLMBlockPool", "VLLMModules", "load_vllm",
           "vllm_available"]

logger = logging.getLogger(__name__)

#: the release this adapter is written against (KVCacheManager's signature and internals change between releases)
VLLM_VERSION = "0.33.0"
#: how to get vLLM for CPU (conformance/adapters/install_vllm.py's command, named, not imported)
INSTALL_HINT = (f"install vLLM {VLLM_VERSION} for CPU with: python -m kvproof.conformance.adapters.install_vllm "
                "--venv PATH  (or: make vllm, which creates .venv-vllm)")
CAPABILITIES: frozenset[Capability] = frozenset({Capability.EXACT_PAGE_ORDER})
#: vLLM's ValueError for a step with nothing to compute and no hit to adopt (kv_cache_manager.py, allocate_slots)
_NOTHING_TO_COMPUTE = "num_new_tokens must be greater than 0"
#: BlockPool.reset_prefix_cache's own log lines (its return value reports the same)
_RESET_LOGS = ("Failed to reset prefix cache", "Successfully reset prefix cache")
_BLOCK_POOL_LOGGER = "vllm.v1.core.block_pool"


# ---------------------------------------------------------------- importing vLLM once


@dataclass(frozen=True)
class VLLMModules:
    """What :func:`load_vllm` imported."""

    version: str
    import_seconds: float
    KVCacheManager: Any
    KVCacheConfig: Any
    KVCacheGroupSpec: Any
    FullAttentionSpec: Any
    SlidingWindowSpec: Any
    Request: Any
    RequestStatus: Any
    SamplingParams: Any
    get_request_block_hasher: Any
    get_block_hash: Any  # BlockHashWithGroupId -> BlockHash
    get_group_id: Any  # BlockHashWithGroupId -> group id
    hash_fn: Any  # vllm.utils.hashing.sha256
    float32: Any  # torch.float32 (the specs' dtype; no tensor is ever made)


_LOADED: VLLMModules | None = None


def vllm_available() -> bool:
    """Whether vLLM is installed (does not import it)."""
    return importlib.util.find_spec("vllm") is not None


class _DropResetLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_RESET_LOGS)


def load_vllm() -> VLLMModules:
    """vLLM's KV cache manager modules, imported once per process, ``NONE_HASH`` initialised as the engine does;
    ``ImportError`` naming what to install without vLLM."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    if not vllm_available():
        raise ImportError(f"vLLM is not installed in this environment ({sys.executable}): {INSTALL_HINT}")
    from importlib.metadata import version

    installed = version("vllm")
    if installed != VLLM_VERSION:
        logger.warning("kvproof: this adapter targets vLLM %s, found %s", VLLM_VERSION, installed)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script_method, reached by vLLM's imports
        torch, manager, utils, interface, request, sampling, hashing = (importlib.import_module(name) for name in (
            "torch", "vllm.v1.core.kv_cache_manager", "vllm.v1.core.kv_cache_utils", "vllm.v1.kv_cache_interface",
            "vllm.v1.request", "vllm.sampling_params", "vllm.utils.hashing"))
    utils.init_none_hash(hashing.sha256)  # EngineCore.__init__ with the default prefix_caching_hash_algo
    logging.getLogger(_BLOCK_POOL_LOGGER).addFilter(_DropResetLogs())
    _LOADED = VLLMModules(installed, time.perf_counter() - start, manager.KVCacheManager, interface.KVCacheConfig,
                          interface.KVCacheGroupSpec, interface.FullAttentionSpec, interface.SlidingWindowSpec,
                          request.Request, request.RequestStatus, sampling.SamplingParams,
                          utils.get_request_block_hasher, utils.get_block_hash, utils.get_group_id, hashing.sha256,
                          torch.float32)
    logger.info("kvproof: imported vLLM %s in %.1fs", installed, _LOADED.import_seconds)
    return _LOADED


# ---------------------------------------------------------------- the adapter


class VLLMBlockPool:
    """vLLM 0.33.0's ``KVCacheManager`` (one ``BlockPool``, full attention + sliding window) as
    :class:`~kvproof.reference.contract.BlockPoolUnderTest`."""

    components = frozenset({Component.BLOCK_POOL})
    capabilities = CAPABILITIES

    def __init__(self, config: BlockPoolConfig) -> None:
        self.vllm = vm = load_vllm()
        self.version = f"vllm {vm.version}"  # reported as the implementation's version
        self.config = config
        b = self.block_size = config.block_size
        spec = {"block_size": b, "num_kv_heads": 1, "head_size": 1, "dtype": vm.float32}
        groups = [vm.KVCacheGroupSpec(["full"], vm.FullAttentionSpec(**spec))]
        if config.sliding_window is not None:
            groups.append(vm.KVCacheGroupSpec(["swa"], vm.SlidingWindowSpec(**spec,
                                                                            sliding_window=config.sliding_window)))
        self.kv_cache_config = vm.KVCacheConfig(num_blocks=config.num_blocks, kv_cache_tensors=[],
                                                kv_cache_groups=groups)
        self.manager = vm.KVCacheManager(self.kv_cache_config, max_model_len=config.max_model_len,
                                         scheduler_block_size=b, hash_block_size=b,
                                         max_in_flight_tokens=config.max_in_flight_tokens, enable_caching=True)
        self.block_pool = self.manager.block_pool
        self._hasher = vm.get_request_block_hasher(b, vm.hash_fn)
        self._requests: dict[int, Any] = {}  # kvproof id -> the vllm Request made for it
        self._learned: dict[int, int] = {}  # kvproof id -> how many of its block_hashes are in _prefixes
        self._prefixes: dict[bytes, tuple[int, ...]] = {}  # BlockHash -> the token prefix it covers
        self._lookup: tuple[tuple[int, ...], int] | None = None  # the last lookup's tokens, shared_prefix_boundary

    def __repr__(self) -> str:
        return f"VLLMBlockPool(vllm {self.vllm.version} KVCacheManager, {self.config.label()})"

    # ------------------------------------------------------------ requests

    def _new_request(self, request_id: str, tokens: Sequence[int]) -> Any:
        vm = self.vllm
        return vm.Request(request_id, list(tokens), vm.SamplingParams(max_tokens=self.config.max_model_len), None,
                          block_hasher=self._hasher)

    def _request(self, op: str, req: int, tokens: Sequence[int]) -> Any:
        """The request's ``Request`` (made on first sight), its tokens brought up to ``tokens``."""
        request = self._requests.get(req)
        if request is None:
            request = self._requests[req] = self._new_request(str(req), tokens)
        else:
            known = request.num_tokens
            if len(tokens) < known or list(tokens[:known]) != list(request.all_token_ids):
                raise InvalidOperation(op, "tokens", f"request {req} has {known} tokens "
                                       f"...{list(request.all_token_ids)[-4:]}; {len(tokens)} tokens "
                                       f"...{list(tokens)[-4:]} do not extend them")
            if len(tokens) > known:
                request.append_output_token_ids(list(tokens[known:]))  # extends request.block_hashes
        self._learn(req, request)
        return request

    def _learn(self, req: int, request: Any) -> None:
        """Record what each new block hash of the request covers: hash ``i`` is the prefix ``tokens[:(i + 1) B]``."""
        b, start = self.block_size, self._learned.get(req, 0)
        tokens = list(request.all_token_ids)
        for i in range(start, len(request.block_hashes)):
            digest, prefix = bytes(request.block_hashes[i]), tuple(tokens[:(i + 1) * b])
            known = self._prefixes.setdefault(digest, prefix)
            if known != prefix:  # sha256 collision, or hashes that are not a function of the prefix
                raise HarnessBug(f"vLLM block hash {digest.hex()[:16]} covers {len(known)} tokens and {len(prefix)}")
        self._learned[req] = len(request.block_hashes)

    def _blocks(self, hit: Hit | None) -> Any:
        """kvproof's hit as vLLM's ``KVCacheBlocks`` of the pool's own blocks (id 0 is ``block_pool.null_block``);
        an empty hit is vLLM's ``empty_kv_cache_blocks``, what its lookup returns on a miss."""
        if hit is None:
            return None
        pool = self.block_pool
        lists = tuple([pool.null_block if x == 0 else pool.blocks[x] for x in group] for group in hit.blocks)
        return self.manager.create_kv_cache_blocks(lists)

    # ------------------------------------------------------------ the manager's operations

    def get_computed_blocks(self, tokens: Sequence[int], max_cache_hit_length: int | None = None) -> Hit:
        lookup = self._new_request("kvproof-lookup", tokens)
        blocks, num_tokens, boundary = self.manager.get_computed_blocks(lookup, max_cache_hit_length)
        self._lookup = (tuple(tokens), int(boundary))
        return Hit(blocks=tuple(tuple(int(x.block_id) for x in group) for group in blocks.blocks),
                   num_tokens=int(num_tokens))

    def allocate_slots(self, req: int, tokens: Sequence[int], num_computed_tokens: int, num_new_tokens: int,
                       hit: Hit | None = None, full_sequence_must_fit: bool = False) -> tuple[tuple[int, ...], ...]:
        op = "allocate_slots"
        vm = self.vllm
        request = self._request(op, req, tokens)
        hit_tokens = hit.num_tokens if hit is not None else 0
        if request.status != vm.RequestStatus.RUNNING:  # Scheduler.schedule: the waiting request's lookup
            looked = self._lookup
            request.shared_prefix_boundary = looked[1] if looked is not None and looked[0] == tuple(tokens) else 0
        request.num_computed_tokens = num_computed_tokens
        blocks = self._blocks(hit)
        try:
            new = self.manager.allocate_slots(request, num_new_tokens, num_new_computed_tokens=hit_tokens,
                                              new_computed_blocks=blocks,
                                              full_sequence_must_fit=full_sequence_must_fit)
        except ValueError as err:
            if _NOTHING_TO_COMPUTE in str(err):
                raise InvalidOperation(op, "num_new_tokens", str(err)) from err
            raise
        if new is None:
            raise OutOfMemory(op, "block", self._refused_need(request, num_new_tokens, hit_tokens, blocks,
                                                              full_sequence_must_fit),
                              self.get_num_free_blocks(), request=req)
        request.status = vm.RequestStatus.RUNNING  # Scheduler.schedule, then _update_after_schedule
        request.num_computed_tokens = num_computed_tokens + hit_tokens + num_new_tokens
        return tuple(tuple(int(x) for x in ids) for ids in new.get_block_ids())

    def _refused_need(self, request: Any, num_new_tokens: int, hit_tokens: int, blocks: Any, must_fit: bool) -> int:
        """The blocks vLLM asked for when it returned ``None``: its own ``get_num_blocks_to_allocate`` with the
        arguments ``allocate_slots`` passed (the admission gate's when that is what refused); it changes nothing."""
        m, lists = self.manager, (blocks or self.manager.empty_kv_cache_blocks).blocks
        computed = request.num_computed_tokens + hit_tokens
        total = min(computed, m.max_model_len)
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        free = self.get_num_free_blocks()
        if must_fit:
            whole = min(request.num_tokens, m.max_model_len)
            need = m.coordinator.get_num_blocks_to_allocate(
                request_id=request.request_id, num_tokens=whole, new_computed_blocks=lists, num_encoder_tokens=0,
                total_computed_tokens=total, num_local_computed_tokens=computed, num_tokens_main_model=whole,
                apply_admission_cap=True, prefill_end=prefill_end)
            if need > free:
                return int(need)
        main = total + num_new_tokens
        return int(m.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id, num_tokens=min(main, m.max_model_len), new_computed_blocks=lists,
            num_encoder_tokens=0, total_computed_tokens=computed, num_local_computed_tokens=computed,
            num_tokens_main_model=main, prefill_end=prefill_end))

    def remove_skipped_blocks(self, req: int, num_computed_tokens: int) -> None:
        request = self._requests.get(req)
        prompt = request.num_prompt_tokens if request is not None else None  # what the scheduler passes
        self.manager.remove_skipped_blocks(str(req), num_computed_tokens, num_prompt_tokens=prompt)

    def free(self, req: int) -> None:
        vm = self.vllm
        request = self._requests.get(req)
        if request is None:  # never seen: a request freed (aborted) before any allocation
            self.manager.free(self._new_request(str(req), [0]))
            return
        self.manager.free(request)
        if request.status == vm.RequestStatus.RUNNING:  # Scheduler._preempt_request's part on the request
            request.status = vm.RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_preemptions += 1

    def cache_blocks(self, req: int, tokens: Sequence[int], num_tokens: int) -> None:
        self.manager.cache_blocks(self._request("cache_blocks", req, tokens), num_tokens)

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        self.manager.evict_blocks({int(x) for x in block_ids})

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def get_num_free_blocks(self) -> int:
        return int(self.block_pool.get_num_free_blocks())

    # ------------------------------------------------------------ observation

    def _key(self, key: bytes) -> BlockKey:
        """vLLM's ``BlockHashWithGroupId`` as kvproof's key: (group, the token prefix its hash covers)."""
        vm = self.vllm
        digest = bytes(vm.get_block_hash(key))
        prefix = self._prefixes.get(digest)
        if prefix is None:
            raise HarnessBug(f"vLLM caches block hash {digest.hex()[:16]}, which no request of this adapter has")
        return int(vm.get_group_id(key)), prefix

    def snapshot(self) -> BlockPoolSnapshot:
        pool, n = self.block_pool, self.config.num_blocks
        # the free queue, front first: FreeKVCacheBlockQueue's doubly linked list, walked by its own method
        free = tuple(int(x.block_id) for x in pool.free_block_queue.get_all_free_blocks())
        # KVCacheBlock.ref_cnt; the null block's is not maintained by vLLM (reported 0, as the reference keeps it)
        ref_cnt = tuple(0 if x.is_null else int(x.ref_cnt) for x in pool.blocks)
        # KVCacheBlock.block_hash: the primary key the block is cached under, or None
        block_key = tuple(None if x.block_hash is None else self._key(x.block_hash) for x in pool.blocks)
        # BlockHashToBlockMap._cache: key -> one KVCacheBlock, or {block_id: KVCacheBlock} (insertion order) for
        # duplicates; plus BlockPool.cached_block_hashes_by_block (secondary keys: partial blocks, empty here)
        cached: dict[BlockKey, tuple[int, ...]] = {}
        for key, held in pool.cached_block_hash_to_block._cache.items():
            ids = tuple(int(i) for i in held) if isinstance(held, dict) else (int(held.block_id),)
            cached[self._key(key)] = ids
        if pool.cached_block_hashes_by_block:
            raise HarnessBug(f"vLLM holds secondary block hashes (partial blocks), out of the adapter's scope: "
                             f"blocks {sorted(pool.cached_block_hashes_by_block)}")
        managers = self.manager.coordinator.single_type_managers
        # SingleTypeKVCacheManager.req_to_blocks (a defaultdict: remove_skipped_blocks of a request holding nothing
        # leaves an empty list behind, which is no request here) and .num_cached_block (absent: nothing cached)
        holders = list(dict.fromkeys(r for m in managers for r, blocks in m.req_to_blocks.items() if blocks))
        requests = {_rid(r): tuple(tuple(int(x.block_id) for x in m.req_to_blocks.get(r, ())) for m in managers)
                    for r in holders}
        num_cached = {_rid(r): tuple(int(m.num_cached_block.get(r, 0)) for m in managers) for r in holders}
        return BlockPoolSnapshot(num_blocks=n, free=free, ref_cnt=ref_cnt, block_key=block_key, cached=cached,
                                 requests=requests, num_cached=num_cached)


def _rid(request_id: str) -> int:
    try:
        return int(request_id)
    except ValueError:
        raise HarnessBug(f"vLLM holds blocks for request {request_id!r}, which the adapter never allocated") from None

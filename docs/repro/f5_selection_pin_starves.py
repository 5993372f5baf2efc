"""F5 (SGLang 0.5.23): ``PrefillAdder.add_one_req`` selects under a lock of the match's last *device* node, and that
pin makes ``SWAPrefillBudget`` count device SWA outside the request's window as taken: a request whose window is a
host tombstone under a Full host prefix is refused forever on an idle pool it fits.

Page size 2, window 4, an SWA pool of 16 tokens of which the tree's two device nodes hold 8 (evictable), chunked
prefill of 6. The 15-token request matched node "a" on device (4 tokens) and a Full host prefix "b", "c" (6 tokens);
its window is c's 4-token host tombstone. Locking "a" pins a's 4 SWA tokens although the window does not need them.

    python f5_selection_pin_starves.py   # on CPU without Triton: PYTHONPATH=<kvproof>/conformance/adapters/_stubs

Exit 10: reproduced; 0: fixed (the request is admitted).
"""
import sys
from array import array

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import PrefillAdder
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=2))


class Tree:  # what PrefillAdder and SWAPrefillBudget read from the tree cache
    sliding_window_size, buffer_pipeline, disable = 4, None, False

    def __init__(self, pin_device_match):
        self.evictable, self.pinned, self.pin_device_match = 8, 0, pin_device_match

    def supports_mamba(self): return False
    def supports_prefix_sharing(self): return True
    def full_evictable_size(self): return 0
    def swa_evictable_size(self): return self.evictable - self.pinned
    def lock(self, node):  # a lock protects the device SWA of the window ending at the node
        tokens = 4 if node == "a" and self.pin_device_match else 0
        self.pinned += tokens
        return tokens
    def unlock(self, tokens): self.pinned -= tokens
    def init_load_back(self, params): return params.host_hit_length, params.best_match_node
    def load_back_is_cache_owned(self): return False
    def finish_storage_prefetch_admission(self, *args, **kwargs): return None
    def discard_storage_prefetch_accounting(self, *args, **kwargs): return None


def one_round(tree):
    pool = SWAKVPool(size=4096, size_swa=16, page_size=2, dtype=torch.float32, head_num=1, head_dim=2,
                     swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    a = SWATokenToKVPoolAllocator(4096, 16, 2, torch.float32, "cpu", pool, need_sort=False)
    a.swa_attn_allocator.alloc(8)  # the SWA pages of the tree's two device nodes
    adder = PrefillAdder(2, tree, a, None, 1.0, 1 << 20, 6)
    req = Req("r", "", array("q", range(15)), SamplingParams(max_new_tokens=0))
    req.refresh_fill_ids()
    req.prefix_len, req.last_node, req.best_match_node = 4, "a", "c"
    req.host_hit_length, req.swa_host_hit_length = 6, 4
    result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    return result.name, req in adder.can_run_list


pinned = [one_round(Tree(pin_device_match=True)) for _ in range(3)]
unpinned = one_round(Tree(pin_device_match=False))
print(f"add_one_req under 0.5.23's lock of 'a', 3 rounds: {pinned}")
print(f"the same request under a lock that pins nothing outside the window: {unpinned}")
print("expected: admitted, as under a lock that pins nothing outside the window (an idle pool: 8 SWA tokens free, "
      "8 evictable)")
print(f"actual:   {pinned[-1][0]}, not admitted, in every round")
sys.exit(10 if not any(admitted for _, admitted in pinned) else 0)

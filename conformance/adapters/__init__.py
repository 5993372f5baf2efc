"""Adapters that put third-party allocators behind kvproof's conformance protocol.

* :mod:`kvproof.conformance.adapters.sglang`: the real SGLang 0.5.23
  ``SWATokenToKVPoolAllocator`` + ``SWAKVPool`` on CPU
  (``--impl kvproof.conformance.adapters.sglang:SGLangSWAAllocator``);
* :mod:`kvproof.conformance.adapters.install_sglang`: installs SGLang without any CUDA package;
* :mod:`kvproof.conformance.adapters.bench_sglang`: the same operations on kvproof's runtime and SGLang's.

Importing this package (or the adapter module) never imports SGLang.
"""

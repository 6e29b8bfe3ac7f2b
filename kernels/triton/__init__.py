"""Triton kernels for the GPU hot paths, one file per op; ``formats`` holds the shared byte codecs.

Import these only through the public ops (``kernels.kv_cache_ops``,
``kernels.sparse_attention``, ``kernels.indexer_ops``), which pick them via
``kernels.dispatch``. Every kernel has a PyTorch reference it is tested against.
"""

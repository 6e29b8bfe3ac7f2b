"""Pure tensor functions: number formats, KV records, weight formats, attention kernels.

``quant`` holds the scalar formats (E2M1, E4M3, E8M0); ``kv_formats`` the KV cache
records and ``weight_formats`` the checkpoint weight formats built from them.
Import from the submodules; this package re-exports nothing.
"""

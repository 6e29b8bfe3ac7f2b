"""Every byte of KV in every tier: device pages, prefix cache, SSD tier, per-request state.

The engine talks to ``KVCacheManager`` (paged global KV) and ``RequestStatePool``
(SWA windows, compressor state). Nothing here imports the engine: layouts are
described by plain numbers (``kv_layout``).
"""

from kvstore.device.block_pool import BlockPool, OutOfPages
from kvstore.device.device_pool import SourcePages, free_device_bytes, pages_for_bytes
from kvstore.device.layout import KVLayout, SourceLayout, kv_layout
from kvstore.device.page_format import pack_records, record_views, unpack_page
from kvstore.device.page_hash import ROOT_HASH, chain_hashes, page_hash
from kvstore.manager import KVCacheManager, RestorePlan
from kvstore.request_state import OutOfRequestSlots, RequestStateLayout, RequestStatePool
from kvstore.ssd.persistent import PersistentStore
from kvstore.stats import KVStats, SSDStats

__all__ = [
    "ROOT_HASH",
    "BlockPool",
    "KVCacheManager",
    "KVLayout",
    "KVStats",
    "OutOfPages",
    "OutOfRequestSlots",
    "PersistentStore",
    "RequestStateLayout",
    "RequestStatePool",
    "RestorePlan",
    "SSDStats",
    "SourceLayout",
    "SourcePages",
    "chain_hashes",
    "free_device_bytes",
    "kv_layout",
    "pack_records",
    "page_hash",
    "pages_for_bytes",
    "record_views",
    "unpack_page",
]

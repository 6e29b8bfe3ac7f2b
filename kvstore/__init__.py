"""Every byte of KV in every tier: device pages, prefix cache, SSD tier, per-request state.

Bookkeeping and bytes are apart: the scheduler and the engine loop talk to a
``KVManager`` (``KVCacheManager`` for one pool: block ids, prefix cache, SSD
index, restore plans), while whoever runs the model owns the bytes: the page
pool (``DevicePool``, which also moves pages to and from the SSD tier) and the
per-request SWA windows and compressor state (``RequestStatePool``).
``open_local_kv`` builds one process's manager and pool together. Nothing here
imports the engine: layouts are described by plain numbers (``kv_layout``).
"""

from kvstore.device.block_pool import BlockPool, OutOfPages
from kvstore.device.device_pool import (
    DevicePool,
    SourcePages,
    free_device_bytes,
    pages_for_bytes,
    require_pages,
)
from kvstore.device.layout import KVLayout, SourceLayout, kv_layout
from kvstore.device.page_format import pack_records, record_views, unpack_page
from kvstore.device.page_hash import ROOT_HASH, SpanKey, chain_hashes, page_hash
from kvstore.local import LocalKV, open_local_kv
from kvstore.manager import KVCacheManager, KVManager, PageBytes, RestorePlan
from kvstore.request_state import OutOfRequestSlots, RequestStateLayout, RequestStatePool
from kvstore.ssd.persistent import PersistentStore
from kvstore.stats import KVStats, SSDStats

__all__ = [
    "ROOT_HASH",
    "BlockPool",
    "DevicePool",
    "KVCacheManager",
    "KVLayout",
    "KVManager",
    "KVStats",
    "LocalKV",
    "OutOfPages",
    "OutOfRequestSlots",
    "PageBytes",
    "PersistentStore",
    "RequestStateLayout",
    "RequestStatePool",
    "RestorePlan",
    "SSDStats",
    "SourceLayout",
    "SourcePages",
    "SpanKey",
    "chain_hashes",
    "free_device_bytes",
    "kv_layout",
    "open_local_kv",
    "pack_records",
    "page_hash",
    "pages_for_bytes",
    "record_views",
    "require_pages",
    "unpack_page",
]

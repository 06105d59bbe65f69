"""KV-cache rows: allocate, insert, append, remove and copy, with the layout documented in ``kv_cache``."""

from cache_api.kv_cache import KVCache, write_step
from cache_api.rows import CacheError, CacheFullError, Occupancy, RowTable

__all__ = ["CacheError", "CacheFullError", "KVCache", "Occupancy", "RowTable", "write_step"]

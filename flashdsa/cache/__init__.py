"""Paged KV caches (docs/DSA.md §4).

- ``layouts``: byte layouts of the MLA cache (bf16 1152 B, fp8 656 B, fp8_raw 576 B per token) and the
  indexer cache (8448-B pages of 64 keys), with their writers and readers.
- ``allocator``: :class:`PageAllocator`, a free list of pages and one block table per request;
  :class:`OutOfPagesError` when it runs out (raised before anything changes).
- ``pool``: :class:`KVPool`, per layer an MLA cache and (top-k layers only) an indexer cache, all
  addressed through one allocator; memory accounting by format; ``KVPool.from_memory`` sizes a pool
  from a byte budget.
"""

from flashdsa.cache.allocator import BLOCK_TABLE_PAD, OutOfPagesError, PageAllocator, slots_from_pages
from flashdsa.cache.pool import KVPool, page_bytes

__all__ = ["BLOCK_TABLE_PAD", "KVPool", "OutOfPagesError", "PageAllocator", "page_bytes", "slots_from_pages"]

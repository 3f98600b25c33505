"""Paged KV caches: byte layouts (layouts.py); pools and the page allocator come with the engine."""

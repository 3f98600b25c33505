"""Decode in a CUDA graph: captured once for a fixed batch, replayed with the metadata refreshed in place."""

from __future__ import annotations

from typing import Sequence

import torch

from flashdsa.cache.metadata import DECODE, build_decode
from flashdsa.engine.runner import Runner


class DecodeGraph:
    """A decode step captured once in a CUDA graph, replayed with the metadata refreshed in place.

    The batch (``req_ids``, live requests) is fixed at capture; ``max_pages`` bounds each request's pages so
    the block table and the logits width keep their shapes. Needs CUDA and the Triton backends (the torch
    references read values on the host, which a graph cannot).
    """

    def __init__(self, runner: Runner, req_ids: list, max_pages: int):
        if runner.pool.device.type != "cuda":
            raise ValueError("runner: CUDA graphs need the model and caches on a CUDA device")
        if runner.offload is not None:
            raise ValueError("runner: host offload syncs with the host in every layer's swap-in, which a CUDA graph "
                             "cannot capture; decode eagerly (Runner.decode)")
        self.runner, self.req_ids, self.max_pages = runner, list(req_ids), max_pages
        self.ids = torch.zeros(len(req_ids), dtype=torch.int64, device=runner.pool.device)
        # Capture on a step whose tokens are reserved, then give them back: replay() reserves its own.
        self.meta, reservation = runner.prepare({r: 1 for r in self.req_ids}, DECODE, max_pages=max_pages)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(2):  # warm up: Triton compiles, allocator settles
                    runner.forward(self.ids, self.meta)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.no_grad():
                self.logits = runner.forward(self.ids, self.meta)
        finally:
            runner.undo(reservation)

    @torch.no_grad()
    def replay(self, tokens: Sequence[int]) -> torch.Tensor:
        """One decode step for the captured batch: ``tokens [B]`` -> ``[B, vocab] float32`` (a view into
        the graph's output buffer; copy it to keep it past the next replay)."""
        ids = self.runner._token_ids("tokens", list(tokens))
        if ids.numel() != len(self.req_ids):
            raise ValueError(f"tokens: expected {len(self.req_ids)} (one per captured request), got {ids.numel()}")
        fresh, reservation = self.runner.prepare({r: 1 for r in self.req_ids}, DECODE, max_pages=self.max_pages)
        try:
            for name in ("positions", "slot_mapping", "block_table", "context_lens"):
                getattr(self.meta, name).copy_(getattr(fresh, name))
            self.ids.copy_(ids)
            self.graph.replay()
        except BaseException:
            self.runner.undo(reservation)
            raise
        return self.logits

"""The engine: the small DSA model, the runner of the forward modes, and CUDA-graph decode.

The per-batch metadata the engine builds lives with the caches (``flashdsa.cache.metadata``); it is
re-exported here.
"""

from flashdsa.cache.metadata import DECODE, DRAFT_EXTEND, EXTEND, TARGET_VERIFY, BatchMetadata, build_decode, build_extend
from flashdsa.engine.graph import DecodeGraph
from flashdsa.engine.model import DSAModel
from flashdsa.engine.runner import Runner

__all__ = ["BatchMetadata", "build_decode", "build_extend", "DSAModel", "Runner", "DecodeGraph",
           "EXTEND", "DECODE", "TARGET_VERIFY", "DRAFT_EXTEND"]

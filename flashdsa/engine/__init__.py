"""The engine: per-batch metadata, the small DSA model, and the runner of the forward modes."""

from flashdsa.engine.metadata import DECODE, DRAFT_EXTEND, EXTEND, TARGET_VERIFY, BatchMetadata, build_decode, build_extend
from flashdsa.engine.model import DSAModel
from flashdsa.engine.runner import DecodeGraph, Runner

__all__ = ["BatchMetadata", "build_decode", "build_extend", "DSAModel", "Runner", "DecodeGraph",
           "EXTEND", "DECODE", "TARGET_VERIFY", "DRAFT_EXTEND"]

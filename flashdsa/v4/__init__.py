"""DeepSeek-V4 (transformers ``deepseek_v4``): its attention configuration, its token compressor (one request
at a time, state carried between calls), its indexer's selection (HF's exact picks, or flashdsa's fp8
kernels), its attention core on flashdsa's sparse MLA kernels, and one layer's step for one request in exact
mode, which ``flashdsa.hf.apply`` runs (issue #43, first steps; the paged caches, batched steps, fp8 mode and
the compressor kernel are not built yet)."""

from flashdsa.v4.attention import attend, causal_entry_indices, mla_rows, window_indices
from flashdsa.v4.compressor import CompressState, compress
from flashdsa.v4.config import CSA, HCA, LAYER_TYPES, SLIDING, V4Config, is_v4
from flashdsa.v4.indexer import scores_exact, select_exact, select_fp8, visible_entries
from flashdsa.v4.layer import V4LayerStep, V4State

__all__ = ["V4Config", "is_v4", "SLIDING", "CSA", "HCA", "LAYER_TYPES", "attend", "window_indices",
           "causal_entry_indices", "mla_rows", "CompressState", "compress", "scores_exact",
           "select_exact", "select_fp8", "visible_entries", "V4LayerStep", "V4State"]

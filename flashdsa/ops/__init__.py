"""Public DSA ops (docs/DSA.md §5). Each dispatches to Triton on CUDA and to the PyTorch reference elsewhere;
``backend="torch" | "triton"`` forces one. Bad input raises ValueError naming the argument (value checks:
``set_value_checks``; deferred ones of the default device checks: ``check_errors``, see flashdsa._checks).
Every op is also registered as ``torch.ops.flashdsa.<name>`` (torch.compile, CUDA graphs, opcheck)."""

from flashdsa.ops._common import check_errors, set_value_checks
from flashdsa.ops.dense_mla import dense_mla_prefill
from flashdsa.ops.indexer import indexer_logits_paged, indexer_logits_ragged, indexer_topk_ragged
from flashdsa.ops.indexer_quant import indexer_quant
from flashdsa.ops.kpool import kpool_compress, kpool_expand
from flashdsa.ops.sparse_mla import attention_sinks, merge_attention, sparse_mla_decode, sparse_mla_prefill
from flashdsa.ops.topk import topk_transform

__all__ = [
    "indexer_logits_ragged", "indexer_logits_paged", "indexer_topk_ragged", "indexer_quant", "topk_transform",
    "kpool_compress", "kpool_expand",
    "sparse_mla_decode", "sparse_mla_prefill", "dense_mla_prefill", "merge_attention", "attention_sinks",
    "set_value_checks",
    "check_errors",
]

"""Context parallelism on ``torch.distributed`` (docs/DSA.md §8): NCCL between GPUs, gloo between CPU processes.

- ``prefill``: :class:`ContextParallel` — each rank computes its share of the prompt's tokens (split
  "interleave" or "zigzag"), all-gathers the MLA cache rows and index keys once per layer, writes the
  whole sequence and runs indexer -> top-k -> sparse MLA for its own queries. Decode runs replicated.
- ``decode``: :class:`DecodeContextParallel` (DCP) — each request's KV sharded over the ranks; per layer a
  local top-k, an exact merge of the candidates, sparse MLA over the rank's own winners, and the partial
  (out, lse) merged with ``merge_attention``: bitwise one process's selection on every rank.
- ``split``: who owns which token; ``comm``: the group (:func:`init` under torchrun), the all-gathers
  and :class:`ParallelError`; ``base``: the hooks the layer and the runner call (:class:`ParallelPlan`).

Give a mode to the runner (``Runner(model, pages, parallel=ContextParallel(comm, "zigzag"))``); the
layer finds the batch's plan in ``BatchMetadata.parallel``. Every rank runs the same batches.
"""

from flashdsa.parallel.base import Parallel, ParallelPlan
from flashdsa.parallel.comm import Comm, ParallelError, init
from flashdsa.parallel.decode import DecodeContextParallel, ShardedAllocator, ShardedPlan, merge_topk
from flashdsa.parallel.prefill import ContextParallel, PrefillPlan
from flashdsa.parallel.split import SPLITS, KVShards, token_owners

__all__ = ["Comm", "ContextParallel", "DecodeContextParallel", "KVShards", "Parallel", "ParallelError",
           "ParallelPlan", "PrefillPlan", "SPLITS", "ShardedAllocator", "ShardedPlan", "init", "merge_topk",
           "token_owners"]

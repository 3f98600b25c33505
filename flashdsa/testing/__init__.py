"""What the tests, ``flashdsa bench`` and ``benchmarks/`` share, one copy each (as DeepGEMM's and
FlashMLA's testing packages):

    compare   cos_diff, masked_cos_diff, assert_close (inf / NaN pattern, then elementwise, then cosine),
              the tie-safe top-k check and the top-k order keys
    inputs    random inputs in our byte layouts (indexer pages, MLA 656-B pages, block tables, decode
              slots, prefill indices), row subsamples, poisoned output buffers
    peers     loading DeepGEMM / sgl-kernel (FlashMLA, fast_topk) and calling them on our layouts
    timing    do_bench medians, CUDA-graph capture and replay (triton / CUDA touched only when called)

Import the module you need (``from flashdsa.testing.compare import cos_diff``). Nothing here is imported
by the library itself, except ``flashdsa.bench``.
"""

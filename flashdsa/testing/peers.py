"""The peers we measure against, loaded when they import and called on our byte layouts.

DeepGEMM (``import deep_gemm``): paged and ragged indexer logits; it reads our 8448-B indexer pages
viewed ``[P, 64, 1, 132]``. sgl-kernel's ops in ``torch.ops.sgl_kernel``: FlashMLA's sparse decode (our
656-B pages viewed ``[P, 64, 1, 656]``) and prefill, and fast_topk. They load from every ``*.so`` in a
folder (an argument, else ``$FLASHDSA_SGL_KERNEL_LIBS``) or else from ``import sgl_kernel``.

Each ``deepgemm_*`` / ``flashmla_*`` / ``fast_topk`` function does the untimed set-up (schedule metadata,
views, the output buffer) once and returns the call to time; the peer must be loaded first.
"""

from __future__ import annotations

import glob
import os
from types import ModuleType
from typing import Any, Callable

import torch

from flashdsa.cache.layouts import INDEX_BYTES_PER_TOKEN, MLA_LATENT, PAGE_SIZE

SGL_LIBS_ENV = "FLASHDSA_SGL_KERNEL_LIBS"


# ---- loading ------------------------------------------------------------------------------------------

def import_deep_gemm() -> tuple[ModuleType | None, str]:
    """``(deep_gemm, "deep_gemm imports")``, or ``(None, why not)`` on any import failure."""
    try:
        import deep_gemm
        return deep_gemm, "deep_gemm imports"
    except Exception as e:  # noqa: BLE001 - any failure means "peer absent"
        return None, f"import deep_gemm: {type(e).__name__}: {e}"[:160]


def load_sgl_kernel(libs: str | None = None) -> tuple[str, list[str]]:
    """Load sgl-kernel's ops into ``torch.ops.sgl_kernel``: every ``*.so`` in the folder ``libs`` (default
    ``$FLASHDSA_SGL_KERNEL_LIBS``), or ``import sgl_kernel`` without a folder. Returns ``(source, errors)``:
    where the ops came from, and one line per library that failed (empty: all loaded)."""
    libs = libs or os.environ.get(SGL_LIBS_ENV)
    errors: list[str] = []
    if not libs:
        try:
            import sgl_kernel  # noqa: F401
        except Exception as e:  # noqa: BLE001
            errors.append(f"import sgl_kernel: {type(e).__name__}: {e}"[:160])
        return "sgl_kernel", errors
    pending = sorted(glob.glob(os.path.join(libs, "*.so")))
    if not pending:
        errors.append(f"no *.so in {libs}")
    failed: list[tuple[str, Exception]] = []
    for _ in range(2):  # a second pass for a library that needs another one loaded first
        failed = []
        for path in pending:
            try:
                torch.ops.load_library(path)
            except Exception as e:  # noqa: BLE001
                failed.append((path, e))
        pending = [p for p, _ in failed]
    errors += [f"{os.path.basename(p)}: {type(e).__name__}: {e}"[:160] for p, e in failed]
    return f"libraries in {libs}", errors


def peer_status(peer_libs: str | None = None) -> dict[str, dict]:
    """Which peers import here, loading sgl-kernel's ops (:func:`load_sgl_kernel` of ``peer_libs``):
    ``{name: {"ok": bool, "why": str}}`` for DeepGEMM, FlashMLA, fast_topk, fast_topk_transform_fused and
    torch.topk."""
    status: dict[str, dict] = {}
    dg, why = import_deep_gemm()
    status["DeepGEMM"] = {"ok": dg is not None, "why": why}
    source, errors = load_sgl_kernel(peer_libs)
    for name, opname in (("FlashMLA", "sparse_decode_fwd"), ("fast_topk", "fast_topk"),
                         ("fast_topk_transform_fused", "fast_topk_transform_fused")):
        ok = hasattr(torch.ops.sgl_kernel, opname)
        status[name] = {"ok": ok, "why": f"torch.ops.sgl_kernel.{opname} from {source}" if ok
                        else "; ".join(errors) or f"{source} has no torch.ops.sgl_kernel.{opname}"}
    status["torch.topk"] = {"ok": True, "why": f"torch {torch.__version__}"}
    return status


# ---- calls on our layouts ------------------------------------------------------------------------------

def deepgemm_paged(q_fp8: torch.Tensor, index_cache: torch.Tensor, weights: torch.Tensor,
                   context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int) -> Callable[[], Any]:
    """DeepGEMM's paged logits, the arguments of ``ops.indexer_logits_paged``: ``q_fp8 [B, n, H, 128] e4m3``,
    ``index_cache [P, 8448] u8``, ``weights [B n, H] f32``, ``context_lens [B, n] i32``, ``block_table
    [B, maxp] i32``. Its schedule is made here, once. The call returns ``[B n, max_context_len] f32``,
    garbage past each row's length (compare inside the lengths only)."""
    import deep_gemm as dg
    md = dg.get_paged_mqa_logits_metadata(context_lens, PAGE_SIZE, dg.get_num_sms())
    kv = index_cache.view(index_cache.shape[0], PAGE_SIZE, 1, INDEX_BYTES_PER_TOKEN)
    return lambda: dg.fp8_paged_mqa_logits(q_fp8, kv, weights, context_lens, block_table, md, max_context_len, False)


def deepgemm_ragged(q_fp8: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                    ks: torch.Tensor, ke: torch.Tensor) -> Callable[[], Any]:
    """DeepGEMM's ragged logits, the arguments of ``ops.indexer_logits_ragged``: ``q_fp8 [T, H, 128] e4m3``,
    ``k_fp8 [N, 128] e4m3``, ``k_scale [N] f32``, ``weights [T, H] f32``, ``ks, ke [T] i32``. The call
    returns ``[T, N] f32``."""
    import deep_gemm as dg
    return lambda: dg.fp8_mqa_logits(q_fp8, (k_fp8, k_scale), weights, ks, ke)


def flashmla_decode(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                    seqlens: torch.Tensor, d_v: int = MLA_LATENT) -> Callable[[], Any]:
    """FlashMLA's sparse decode over our pages: ``q [B, s_q, h_q, 576] bf16`` (h_q 64 or 128), ``kv_cache
    [P, 64, 656] u8``, ``indices [B, s_q, topk] i32`` slots, ``seqlens [B] i32``. Its tile scheduler
    metadata is made here, once. The call returns ``(out [B, s_q, h_q, d_v] bf16, lse)``."""
    _, s_q, h_q, _ = q.shape
    sgl = torch.ops.sgl_kernel
    md, ns = sgl.get_mla_decoding_metadata.default(seqlens, s_q * h_q, 1, h_q, True, indices.shape[-1])
    kv = kv_cache.view(kv_cache.shape[0], PAGE_SIZE, 1, kv_cache.shape[-1])
    return lambda: sgl.sparse_decode_fwd.default(q, kv, indices, None, None, md, ns, None, None, None, d_v, sm_scale)


def flashmla_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                     d_v: int = MLA_LATENT) -> Callable[[], Any]:
    """FlashMLA's sparse prefill: ``q [T, h_q, 576] bf16`` (h_q a multiple of 64), ``kv [N, 576] bf16``,
    ``indices [T, topk] i32`` (topk a multiple of 128). The call returns ``(out [T, h_q, d_v] bf16,
    max_logits, lse)``."""
    T, N = q.shape[0], kv.shape[0]
    kv3, idx3 = kv.view(N, 1, kv.shape[-1]), indices.view(T, 1, indices.shape[-1])
    return lambda: torch.ops.sgl_kernel.sparse_prefill_fwd.default(q, kv3, idx3, sm_scale, d_v, None, None)


def fast_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[Callable[[], Any], torch.Tensor]:
    """sgl-kernel's fast_topk (k = 2048 only): ``scores [R, L] f32``, ``lengths [R] i32``. Returns the call
    and the ``[R, k] int32`` buffer of positions (untranslated) it writes."""
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    return (lambda: torch.ops.sgl_kernel.fast_topk(scores, out, lengths, None)), out


def fast_topk_v2(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> Callable[[], torch.Tensor]:
    """sgl-kernel's fast_topk as its Python entry ``sgl_kernel.fast_topk_v2`` calls it: the same checks
    (k 2048, 2-D scores) and a new ``[R, k] int32`` output per call, then the op. The pinned build ships the
    op library without its Python package, so the entry is restated here; it is the form a serving engine
    calls, and the one to compare an op that allocates its own output with (host cost)."""
    op = torch.ops.sgl_kernel.fast_topk

    def call():
        assert k == 2048 and scores.dim() == 2
        out = scores.new_empty((scores.size(0), k), dtype=torch.int32)
        op(scores, out, lengths, None)
        return out
    return call


def fast_topk_transform_fused(lengths: torch.Tensor, token_table: torch.Tensor,
                              k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """sgl-kernel's top-2048 with slot translation as SGLang's DSA decode calls it, one query row a request
    (``cu_seqlens_q = 0..R``): ``call(scores [R, L] f32)`` with ``lengths [R] i32`` and ``token_table
    [R, >= L] i32`` (the slot of each position: SGLang's page table of page size 1). Each call returns a new
    ``[R, k] int32`` of slots (-1 past a row's length), in the kernel's own order within a row."""
    op = torch.ops.sgl_kernel.fast_topk_transform_fused
    cu = torch.arange(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)

    def call(scores):
        out = scores.new_empty((scores.size(0), k), dtype=torch.int32)
        op(scores, lengths, out, token_table, cu, None)
        return out
    return call

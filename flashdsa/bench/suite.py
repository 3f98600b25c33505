"""Which cases ``flashdsa bench`` runs: docs/DSA.md §9's shapes per op, the peers each is timed against.

Cases (``--quick`` keeps those marked Q; the sweeps feed the plot):

    indexer     paged logits B 64, next_n 1, context ~U(0.7, 1.3) x {4K Q, 8K, 16K Q, 32K Q, 64K Q, 128K}
                paged logits B 64, next_n 2, context ~32K Q                       peer: DeepGEMM paged
                paged logits B 64, next_n 4, context ~32K (the Gluon kernel on sm_90)   peer: none
                ragged logits 4096 x 16384 Q, 8192 x 32768                        peer: DeepGEMM ragged
    topk        top-2048 of [64, 32K] Q, [64, 128K], [4096, 8K], [4096, 32K] Q      peers: fast_topk, torch.topk
    selection   decode selection: paged logits -> top-2048 -> physical slots, B 64, next_n 1, context
                ~U(0.7, 1.3) x {8K Q, 32K Q, 128K}, as one chain (issue #17's bar)
                                          peer: DeepGEMM paged -> sgl-kernel fast_topk_transform_fused
    sparse_mla  decode fp8 656, B 64, s_q 1, h_q 128, top-2048, context {4K Q, 16K Q, 32K Q, 64K Q}
                (top-k fixed, so the time is flat in context)                     peer: FlashMLA decode
                full run also: fp8 B 64 s_q 2 h_q 128 and B 128 s_q 2 h_q 64, and bf16 pages B 64 h_q 128 and
                B 128 s_q 2 h_q 64 (FlashMLA reads fp8 pages of the same tokens: it has no bf16-cache sparse
                decode), 32K Q
                prefill bf16, T 4096, h_q 128, top-2048 over 8K Q / 32K keys      peer: FlashMLA prefill
    layer       one V3.2 decode step of one layer the way flashdsa.engine runs it (paged indexer -> top-k
                with slot translation -> sparse decode), B 64 at context 8K and 32K Q, split into indexer /
                top-k / attention / whole step; the step's peer is DeepGEMM + fast_topk_transform_fused (fast_topk,
                untranslated, where the sgl-kernel build lacks it) + FlashMLA in a row
    prefill     one V3.2 layer's prefill of a 4K / 32K Q / 128K prompt in chunks of 4096 query rows, through the
                layer's extend stages on fp8 pages (index keys gathered -> indexer_topk_ragged; the pages read to
                bf16; sparse_mla_prefill): the last chunk's stages, the last chunk and the whole prompt, timed as
                plain calls, each with the extra peak memory of one call
                          peers: DeepGEMM ragged -> fast_topk (the [T, N] logits) -> FlashMLA prefill
    host        host µs of one plain (eager) call of each public op at the V3.2 decode shapes, B 64, context
                8K and 32K Q, with the GPU kept busy so only the launch path counts, and the plain-call decode
                step against its CUDA-graph replay (flashdsa.testing.host_cost; issue #18's targets as PASS /
                FAIL lines, which do not change the exit code)      peers: DeepGEMM, fast_topk_v2, FlashMLA
    decode-grid the layer's decode step (as ``layer``: its three stages and the step) over a grid of batch x
                attention heads a GPU holds x context x query rows a request (``--grid``, :func:`parse_grid`;
                default the whole of GRID, --quick QUICK_GRID); not in the default --ops (the whole grid is
                192 cells, about half an hour on an H200). The plot is a heat map of the step's ratio.
                          peers: as layer's; FlashMLA with q padded to 64 / 128 heads where h is not one of those
"""

from __future__ import annotations

from dataclasses import dataclass

OPS = ("indexer", "topk", "selection", "sparse_mla", "layer", "prefill", "host", "decode-grid")
DEFAULT_OPS = OPS[:-1]  # the grid runs when asked for
GRID = {"B": (1, 2, 4, 8, 16, 32, 64, 128), "h": (16, 32, 64, 128), "ctx": (8192, 32768, 131072), "n": (1, 2)}
QUICK_GRID = {"B": (1, 4, 16, 64), "h": (16, 128), "ctx": (32768,), "n": (1,)}
TINY_GRID = {"B": (2,), "h": (8,), "ctx": (200,), "n": (1, 2)}  # the tiny preset has 4 heads
HOST_CTX = (8 * 1024, 32 * 1024)  # the host cost's contexts (--quick: the last)
K = 1024
PLOT_SWEEPS = {"indexer_paged": "paged indexer logits, B 64, next_n 1",
               "sparse_decode": "sparse MLA decode, fp8 656, B 64, h_q 128, top-2048"}


@dataclass(frozen=True)
class Case:
    op: str                  # one of OPS
    kind: str                # paged | ragged | topk | decode | prefill | layer (picks the setup function)
    name: str
    params: dict
    sweep: str | None = None  # rows of a context sweep (a plot panel); x = params["ctx"]


def _ctx_name(ctx: int) -> str:
    return f"{ctx // K}K" if ctx >= K else str(ctx)


def cases(ops: tuple[str, ...] = DEFAULT_OPS, quick: bool = False, tiny: bool = False,
          grid: dict | None = None) -> list[Case]:
    """The cases of ``ops`` in run order: docs/DSA.md §9's shapes, or ``tiny`` ones for the CPU check;
    ``grid`` (as :func:`parse_grid` returns) the decode-grid's cells instead of its default."""
    out = _cases(ops, quick, tiny)
    if "decode-grid" in ops:
        g = grid or (TINY_GRID if tiny else QUICK_GRID if quick else GRID)
        preset = "tiny" if tiny else "v32"
        for ctx in g["ctx"]:
            for n in g["n"]:
                for B in g["B"]:
                    for h in g["h"]:
                        out.append(Case("decode-grid", "layer", f"{preset} decode B{B} h{h} n{n} ctx {_ctx_name(ctx)}",
                                        dict(preset=preset, B=B, h=h, n=n, ctx=ctx)))
    return out


def parse_grid(text: str) -> dict:
    """``"B=1,4;h=16,128;ctx=32K,128K;n=1"`` -> the decode-grid's cells: a dict of B, h, ctx and n, each a tuple
    of positive ints (K = 1024); a key left out takes GRID's values. ValueError naming ``grid`` otherwise."""
    out = dict(GRID)
    for part in filter(None, (p.strip() for p in str(text).split(";"))):
        key, sep, vals = part.partition("=")
        key = key.strip()
        try:
            if not sep or key not in GRID:
                raise ValueError
            nums = tuple(int(v.strip()[:-1]) * K if v.strip().upper().endswith("K") else int(v)
                         for v in vals.split(","))
            if not nums or min(nums) < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"grid: expected 'KEY=v,v;...' with KEY one of {', '.join(GRID)} and positive integers "
                             f"(32K = 32768), got {part!r}") from None
        out[key] = nums
    return out


def _cases(ops: tuple[str, ...], quick: bool, tiny: bool) -> list[Case]:
    out: list[Case] = []
    if tiny:  # every kind of case, small enough for the Triton interpreter
        if "indexer" in ops:
            if not quick:
                out.append(Case("indexer", "paged", "paged B3 n1 ctx~200", dict(B=3, n=1, ctx=200, H=8)))
            out.append(Case("indexer", "paged", "paged B2 n2 ctx~150", dict(B=2, n=2, ctx=150, H=8)))
            out.append(Case("indexer", "ragged", "ragged 12x100", dict(T=12, N=100, H=8)))
        if "topk" in ops:
            out.append(Case("topk", "topk", "top-64 of [3, 700]", dict(R=3, L=700, k=64, pages=False)))
            if not quick:
                out.append(Case("topk", "topk", "top-64 of [5, 300] pages", dict(R=5, L=300, k=64, pages=True)))
        if "sparse_mla" in ops:
            out.append(Case("sparse_mla", "decode", "decode fp8 B2 s_q2 h16 top-64 ctx 256",
                            dict(B=2, s_q=2, h=16, topk=64, ctx=256)))
            if not quick:
                out.append(Case("sparse_mla", "decode", "decode bf16 B2 s_q1 h16 top-64 ctx 256",
                                dict(B=2, s_q=1, h=16, topk=64, ctx=256, fmt="bf16")))
            out.append(Case("sparse_mla", "prefill", "prefill bf16 T4 N200 h16 top-64",
                            dict(T=4, N=200, h=16, topk=64)))
        if "selection" in ops:
            out.append(Case("selection", "selection", "selection B3 n1 ctx~300 top-64", dict(B=3, ctx=300, H=8, k=64)))
        if "layer" in ops:
            out.append(Case("layer", "layer", "tiny decode B2 ctx 200", dict(preset="tiny", B=2, ctx=200)))
        if "prefill" in ops:  # the tiny preset's top-64: a 150-token prompt in chunks of 64 rows selects
            out.append(Case("prefill", "layer_prefill", "tiny prefill ctx 150 chunk 64",
                            dict(preset="tiny", ctx=150, chunk=64)))
        return out
    sweep = (4 * K, 16 * K, 32 * K, 64 * K) if quick else (4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K)
    if "indexer" in ops:
        for ctx in sweep:
            out.append(Case("indexer", "paged", f"paged B64 n1 ctx~{_ctx_name(ctx)}", dict(B=64, n=1, ctx=ctx, H=64),
                            sweep="indexer_paged"))
        out.append(Case("indexer", "paged", "paged B64 n2 ctx~32K", dict(B=64, n=2, ctx=32 * K, H=64)))
        if not quick:  # MTP verify with 4 draft rows: the Gluon kernel's case (DeepGEMM stops at 2)
            out.append(Case("indexer", "paged", "paged B64 n4 ctx~32K", dict(B=64, n=4, ctx=32 * K, H=64)))
        for T, N in [(4096, 16 * K)] + ([] if quick else [(8192, 32 * K)]):
            out.append(Case("indexer", "ragged", f"ragged {T}x{N}", dict(T=T, N=N, H=64)))
    if "topk" in ops:
        shapes = [(64, 32 * K), (4096, 32 * K)] if quick else \
            [(64, 32 * K), (64, 128 * K), (4096, 8 * K), (4096, 32 * K)]
        for R, L in shapes:
            out.append(Case("topk", "topk", f"top-2048 of [{R}, {_ctx_name(L)}]", dict(R=R, L=L, k=2048, pages=False)))
    if "selection" in ops:
        for ctx in [8 * K, 32 * K] + ([] if quick else [128 * K]):
            out.append(Case("selection", "selection", f"selection B64 n1 ctx~{_ctx_name(ctx)}",
                            dict(B=64, ctx=ctx, H=64)))
    if "sparse_mla" in ops:
        for ctx in sweep:
            out.append(Case("sparse_mla", "decode", f"decode fp8 B64 h128 top-2048 ctx {_ctx_name(ctx)}",
                            dict(B=64, s_q=1, h=128, topk=2048, ctx=ctx), sweep="sparse_decode"))
        if not quick:  # the other decode shapes, and our bf16 pages against FlashMLA's fp8 ones
            for B, s_q, h, fmt in [(64, 2, 128, "fp8"), (128, 2, 64, "fp8"), (64, 1, 128, "bf16"), (128, 2, 64, "bf16")]:
                out.append(Case("sparse_mla", "decode", f"decode {fmt} B{B} s_q{s_q} h{h} top-2048 ctx 32K",
                                dict(B=B, s_q=s_q, h=h, topk=2048, ctx=32 * K, fmt=fmt)))
        for N in [8 * K] + ([] if quick else [32 * K]):
            out.append(Case("sparse_mla", "prefill", f"prefill bf16 T4096 N{_ctx_name(N)} h128 top-2048",
                            dict(T=4096, N=N, h=128, topk=2048)))
    if "layer" in ops:
        for ctx in ([] if quick else [8 * K]) + [32 * K]:
            out.append(Case("layer", "layer", f"v32 decode B64 ctx {_ctx_name(ctx)}",
                            dict(preset="v32", B=64, ctx=ctx)))
    if "prefill" in ops:
        for ctx in ([] if quick else [4 * K]) + [32 * K] + ([] if quick else [128 * K]):
            out.append(Case("prefill", "layer_prefill", f"v32 prefill ctx {_ctx_name(ctx)} chunk 4K",
                            dict(preset="v32", ctx=ctx, chunk=4 * K)))
    return out


def peers_of(case: Case) -> str:
    """The peers a case is timed against (when they import)."""
    if case.kind == "paged" and case.params["n"] > 2:
        return "none (DeepGEMM: next_n <= 2 on Hopper)"
    if case.kind == "topk":
        return "none (peers do not translate slots)" if case.params["pages"] else "fast_topk, torch.topk"
    if case.kind == "selection":
        return "DeepGEMM paged -> fast_topk_transform_fused" if case.params.get("k", 2048) == 2048 else "none (k 2048)"
    return {"paged": "DeepGEMM", "ragged": "DeepGEMM", "decode": "FlashMLA", "prefill": "FlashMLA",
            "layer": "DeepGEMM / fast_topk_transform_fused / FlashMLA per stage, the three in a row for the step"
                     + ("" if case.params.get("h", 128) in (64, 128) else " (FlashMLA's q padded to 64 / 128 heads)"),
            "layer_prefill": "DeepGEMM ragged -> fast_topk / FlashMLA prefill per stage, the three in a row per chunk"
            }[case.kind]


def parse_ops(text: str) -> tuple[str, ...]:
    """``"topk,indexer"`` -> ``("indexer", "topk")`` (run order); ValueError naming ``ops`` otherwise."""
    names = [s.strip() for s in str(text).split(",") if s.strip()]
    bad = [s for s in names if s not in OPS]
    if not names or bad:
        raise ValueError(f"ops: expected a comma-separated subset of {','.join(OPS)}, got {text!r}")
    return tuple(op for op in OPS if op in names)


def _host_ctx(quick: bool) -> tuple[int, ...]:
    return HOST_CTX[-1:] if quick else HOST_CTX

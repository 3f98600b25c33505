"""The DSA cost model (``flashdsa plan``): KV bytes, FLOPs, the indexer crossover, TP vs CP traffic, memory.

Everything here is arithmetic over a :class:`~flashdsa.config.DSAConfig`; nothing is measured. The
definitions follow docs/DSA.md §1, §4 and §8. Notation:

    L      num_hidden_layers            L_I   layers with an indexer (``cfg.topk_layers``; skip-top-k
    h_q    num_attention_heads                layers build no indexer and keep no indexer cache)
    H_I    index_n_heads                D_I   index_head_dim
    k      index_topk                   c     index_kpool (pooled keys: indexer scan and cache / c)
    d_c    kv_lora_rank (512)           d_r   qk_rope_head_dim (64); MLA cache dims d_c + d_r = 576
    S      context (history tokens)     p     ranks (GPUs)

KV bytes per token and layer: MLA bf16 1152, fp8 656 (FlashMLA), fp8_raw 576 (NoPE, d_r 0: 1024, 528, 512);
indexer 132 / c (only on the L_I indexer layers). All layers: ``mla * L + 132 / c * L_I``.

FLOPs per query token and layer (2 per multiply-add; the attention part only, no projections):

    indexer     2 H_I D_I S / c            (fp8; one history token costs 2 H_I D_I = 16384 for V3.2)
    sparse MLA  2 h_q (d_c + d_r + 512) min(S, k')   (bf16; one attended token costs 278528 for V3.2)
    dense MLA   2 h_q (d_c + d_r + 512) S

k' = k + c - 1 is the widest selection (kpool: topk / c groups of c tokens plus the unfinished tail group,
up to c - 1 tokens; k' = k without kpool). Crossover: the smallest S at which the indexer's FLOPs reach
sparse MLA's; for S > k' that is ``S = 2 h_q 1088 k' c / (2 H_I D_I)`` (34816 for V3.2 and GLM-5).

Prefill communication per rank per layer (T = S, docs/DSA.md §8), in bytes:

    TP indexer logits all-reduce   2 (p-1)/p * 4 S * S/c     (fp32 [T, S/c] logits; why TP replicates it)
    CP indexer key all-gather        (p-1)/p * 2 D_I S       (bf16 keys, before pooling: 256 S)
    TP o_proj all-reduce           2 (p-1)/p * 2 hidden S    (bf16 [T, hidden])
    CP MLA latent all-gather         (p-1)/p * 2 (d_c + d_r) S  (bf16 latent + rope: 1152 S)

What flashdsa's parallel modes move (measured by ``flashdsa demo --cp / --dcp``), per rank per layer with
an indexer:

    prefill CP  one all-gather padded to ceil(S/p) tokens per rank: (p-1) ceil(S/p) (2 (d_c + d_r) + D_I + 4)
                (the cache row, then the index key in fp8 with its fp32 scale: 1152 + 132 B a token; docs/DSA.md §8's
                (p-1)/p S figures when p divides S, with the key in fp8 instead of bf16)
    DCP decode  R = batch query rows: top-k candidates (p-1) R k 8 (fp32 score + int32 position) and
                partial attention (p-1) R h_q (2 d_c + 4) (bf16 output + fp32 lse; every layer)

Memory: the KV cache of ``batch`` requests of ``context`` tokens each, rounded up to whole pages
(``cfg.page_size`` tokens), on each of ``gpus`` GPUs. ``parallel="tp"``: every rank holds the whole KV
(MLA has one KV head, so tensor parallelism cannot split the latent, and the indexer is replicated);
``parallel="cp"``: the KV is sharded over the ranks (decode context parallelism, DCP), each holds
``ceil(context / gpus)`` tokens of every request. docs/DSA.md §8's prefill CP writes the full sequence on every
rank, so for it use the ``tp`` figure. Model weights are not included (a DSAConfig has no MoE sizes);
:func:`attention_params` counts the attention block's parameters separately.
"""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction
from typing import Any

from flashdsa.cache.layouts import BYTES_PER_TOKEN, INDEX_PAGE_BYTES, MLA_FORMATS, mla_row_bytes
from flashdsa.config import PRESETS, DSAConfig

PARALLEL_MODES = ("tp", "cp")
DEFAULT_CONTEXT = 131072
DEFAULT_GPUS = 8

DEFINITIONS = {
    "kv_bytes_per_token": "bytes one token keeps in the caches, summed over all layers; MLA: bf16 1152 / fp8 656 / "
                          "fp8_raw 576 per layer on every layer; indexer: 132 / index_kpool per layer on the "
                          "layers with an indexer only (skip-top-k layers keep no indexer cache)",
    "indexer_share": "indexer bytes / (MLA bytes in kv_format + indexer bytes), all layers",
    "flops_per_token": "FLOPs (2 per multiply-add) of one query token in one layer with an indexer, attention "
                       "part only: indexer 2*H_I*D_I*S/c (fp8), sparse_mla 2*h_q*(576+512)*min(S, topk), "
                       "dense_mla 2*h_q*(576+512)*S (bf16); all_layers: indexer on the indexer layers, MLA on all",
    "crossover_context": "smallest context S at which the indexer's FLOPs reach sparse MLA's, per indexer layer "
                         "(= 2*h_q*1088*topk*c / (2*H_I*D_I) when above topk); all_layers counts every layer",
    "comm_bytes_per_rank_per_layer": "prefill (T = S = context), p = gpus ranks, bytes received per rank in one "
                                     "layer with an indexer: tp_indexer 2(p-1)/p*4*S*S/c (fp32 logits all-reduce), "
                                     "cp_indexer (p-1)/p*2*D_I*S (bf16 key all-gather), tp_mla "
                                     "2(p-1)/p*2*hidden*S (bf16 o_proj all-reduce), cp_mla (p-1)/p*2*576*S "
                                     "(bf16 latent all-gather); docs/DSA.md §8",
    "cp_gather_bytes_per_rank_per_layer": "what flashdsa's prefill CP receives per rank in one layer with an "
                                          "indexer, T = S = context over p = gpus ranks: one all-gather padded to "
                                          "ceil(S/p) tokens per rank, mla (p-1)*ceil(S/p)*2*576 (bf16 cache rows), "
                                          "indexer (p-1)*ceil(S/p)*(D_I+4) (fp8 key + fp32 scale; kpool: 4*D_I, "
                                          "the bf16 key and pooling gate before pooling)",
    "dcp_bytes_per_rank_per_layer": "what flashdsa's DCP receives per rank in one decode step and layer with an "
                                    "indexer, batch query rows over p = gpus ranks: topk_candidates "
                                    "(p-1)*batch*topk*8 (fp32 score + int32 position), partial_attention "
                                    "(p-1)*batch*h_q*(2*512+4) (bf16 output + fp32 lse)",
    "comm_tp_over_cp": "TP bytes / CP bytes of comm_bytes_per_rank_per_layer, independent of p: indexer "
                       "4*S/(c*D_I), mla 2*hidden/576",
    "memory_gb": "KV cache per GPU in GB (1e9 bytes) for batch requests of context tokens, whole pages; tp: every "
                 "rank holds the whole KV (one KV head, indexer replicated); cp: KV sharded over the gpus "
                 "(DCP), ceil(context/gpus) tokens per request per rank; weights not included",
    "attention_params": "parameters of the attention block, all layers: MLA q_a/q_a_norm/q_b/kv_a/kv_a_norm/"
                        "kv_b/o_proj on every layer, indexer wq_b/wk/k_norm/weights_proj on indexer layers; "
                        "MoE/MLP, embeddings and kpool gates not counted",
}


# ---- numbers ---------------------------------------------------------------------------------------

def _num(x: Fraction | int | float) -> int | float:
    """An exact value as an int when it is whole, else a float (JSON-friendly)."""
    x = Fraction(x)
    return int(x) if x.denominator == 1 else float(x)


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value


def _indexer_bytes_per_layer(cfg: DSAConfig) -> Fraction:
    # One 8448-byte page holds 64 (pooled) keys, i.e. 64 * c tokens.
    return Fraction(BYTES_PER_TOKEN["index"], cfg.index_kpool)


def _mla_bytes(cfg: DSAConfig, kv_format: str) -> int:
    """One token's MLA row in ``kv_format``: the NoPE rows (``qk_rope_head_dim`` 0) have no rope part."""
    return mla_row_bytes(kv_format, cfg.qk_rope_head_dim)


def _mla_unit(cfg: DSAConfig) -> int:
    """FLOPs per attended token per query token: QK^T over 576 dims (NoPE 512) + PV over 512, all h_q heads."""
    return 2 * cfg.num_attention_heads * (cfg.kv_cache_dim + cfg.kv_lora_rank)


def _indexer_unit(cfg: DSAConfig) -> int:
    """FLOPs per scanned (pooled) key per query token: H_I dot products of D_I dims."""
    return 2 * cfg.index_n_heads * cfg.index_head_dim


# ---- the model -------------------------------------------------------------------------------------

def kv_bytes_per_token(cfg: DSAConfig) -> dict[str, Any]:
    """KV cache bytes one token costs, per layer and summed over all layers.

    Returns ``{"per_layer": {...}, "all_layers": {...}}``, each with ``mla`` (per format), ``indexer`` and
    ``total`` (per format, MLA + indexer); ``all_layers`` also has ``dense_bf16`` (a dense MLA model: bf16
    latent, no indexer). ``per_layer`` describes a layer WITH an indexer. V3.2: dense 70272, fp8 40016,
    fp8 + indexer 48068 bytes.
    """
    L, L_I = cfg.num_hidden_layers, len(cfg.topk_layers)
    idx = _indexer_bytes_per_layer(cfg)
    per_layer = {"mla": {f: _mla_bytes(cfg, f) for f in MLA_FORMATS}, "indexer": _num(idx),
                 "total": {f: _num(_mla_bytes(cfg, f) + idx) for f in MLA_FORMATS}}
    idx_all = idx * L_I
    all_layers = {"mla": {f: _mla_bytes(cfg, f) * L for f in MLA_FORMATS}, "indexer": _num(idx_all),
                  "total": {f: _num(_mla_bytes(cfg, f) * L + idx_all) for f in MLA_FORMATS},
                  "dense_bf16": _mla_bytes(cfg, "bf16") * L}
    return {"per_layer": per_layer, "all_layers": all_layers}


def indexer_share(cfg: DSAConfig, kv_format: str = "fp8") -> float:
    """Fraction of a token's KV bytes (all layers) held by the indexer cache, next to a ``kv_format`` MLA cache."""
    _check_choice("kv_format", kv_format, MLA_FORMATS)
    idx = _indexer_bytes_per_layer(cfg) * len(cfg.topk_layers)
    return float(idx / (_mla_bytes(cfg, kv_format) * cfg.num_hidden_layers + idx))


def flops_per_token(cfg: DSAConfig, context: int) -> dict[str, Any]:
    """FLOPs of one query token at ``context`` history tokens (see the module docstring for the formulas).

    Top level: one layer with an indexer (``indexer``, ``sparse_mla``, ``dense_mla``); ``all_layers``: the
    indexer on the indexer layers only, MLA on every layer; ``per_history_token``: the unit costs
    (V3.2: indexer 16384, mla 278528).
    """
    S = _check_positive("context", context)
    c, L, L_I = cfg.index_kpool, cfg.num_hidden_layers, len(cfg.topk_layers)
    indexer = Fraction(_indexer_unit(cfg) * S, c)
    sparse = _mla_unit(cfg) * min(S, cfg.selected_tokens)
    dense = _mla_unit(cfg) * S
    return {
        "context": S,
        "indexer": _num(indexer), "sparse_mla": sparse, "dense_mla": dense,
        "indexer_over_sparse_mla": float(indexer / sparse),
        "per_history_token": {"indexer": _num(Fraction(_indexer_unit(cfg), c)), "mla": _mla_unit(cfg)},
        "all_layers": {"indexer": _num(indexer * L_I), "sparse_mla": sparse * L, "dense_mla": dense * L},
    }


def crossover_context(cfg: DSAConfig, all_layers: bool = False) -> int:
    """Smallest context S (>= 1) at which the indexer's FLOPs reach sparse MLA's.

    Per layer with an indexer by default; ``all_layers=True`` weighs the indexer by the L_I indexer layers
    and MLA by all L layers. Above top-k sparse MLA is flat, so ``S = mla_unit * k * c / indexer_unit``
    (times L / L_I for all layers): 34816 for V3.2 ("about 35K").
    """
    idx_unit = Fraction(_indexer_unit(cfg), cfg.index_kpool)
    mla_unit = Fraction(_mla_unit(cfg))
    if all_layers:
        idx_unit *= len(cfg.topk_layers)
        mla_unit *= cfg.num_hidden_layers
    if idx_unit >= mla_unit:  # then the indexer costs at least as much from the first token on
        return 1
    return math.ceil(mla_unit * cfg.selected_tokens / idx_unit)


def comm_bytes_per_rank_per_layer(cfg: DSAConfig, context: int, gpus: int) -> dict[str, Any]:
    """Prefill traffic (T = S = ``context``) each of ``gpus`` ranks receives in one layer with an indexer.

    ``tp_indexer`` is what TP would cost if it split the indexer's heads (the fp32 [T, S/c] logits
    all-reduce, O(S^2)), which is why TP replicates the indexer instead; ``cp_indexer`` is CP's bf16 key
    all-gather (keys gathered before pooling). ``tp_mla`` / ``cp_mla``: o_proj all-reduce vs latent
    all-gather. All zero for one rank; :func:`comm_tp_over_cp` gives the ratios.
    """
    S, p = _check_positive("context", context), _check_positive("gpus", gpus)
    c = cfg.index_kpool
    ring = Fraction(p - 1, p)  # share of a gathered tensor that comes from the other ranks
    per_rank = {
        "tp_indexer": 2 * ring * 4 * S * Fraction(S, c),
        "cp_indexer": ring * 2 * cfg.index_head_dim * S,
        "tp_mla": 2 * ring * 2 * cfg.hidden_size * S,
        "cp_mla": ring * 2 * cfg.kv_cache_dim * S,
    }
    return {k: _num(v) for k, v in per_rank.items()}


def cp_gather_bytes_per_rank_per_layer(cfg: DSAConfig, context: int, gpus: int) -> dict[str, int]:
    """What flashdsa's prefill CP (``flashdsa.parallel.ContextParallel``) receives per rank in one layer with
    an indexer, T = S = ``context`` tokens over ``gpus`` ranks: ``mla``, ``indexer`` and ``total`` bytes.

    Its one all-gather per layer pads every rank to ceil(S/p) tokens (both splits keep every rank within
    one token of S/p), each a bf16 cache row (2 (d_c + d_r) B) and an fp8 index key with its fp32 scale
    (D_I + 4 B). Equal to :func:`comm_bytes_per_rank_per_layer`'s ``cp_mla`` when p divides S; the key
    costs (D_I + 4) / (2 D_I) = 52 % of its ``cp_indexer``. (An exact-precision indexer sends 2 D_I.) With
    kpool the key is gathered before pooling: the bf16 key and its bf16 pooling gate, 4 D_I B a token.
    """
    S, p = _check_positive("context", context), _check_positive("gpus", gpus)
    rows = (p - 1) * math.ceil(S / p)
    key = 4 * cfg.index_head_dim if cfg.index_kpool > 1 else cfg.index_head_dim + 4
    out = {"mla": rows * 2 * cfg.kv_cache_dim, "indexer": rows * key}
    out["total"] = out["mla"] + out["indexer"]
    return out


def dcp_bytes_per_rank_per_layer(cfg: DSAConfig, rows: int, gpus: int) -> dict[str, int]:
    """What flashdsa's DCP (``flashdsa.parallel.DecodeContextParallel``) receives per rank in one decode step
    of ``rows`` query rows (batch x next_n) and one layer with an indexer: ``topk_candidates`` (every rank's
    top-k, fp32 score + int32 position: (p-1) R k 8), ``partial_attention`` (bf16 output and fp32 lse per
    head: (p-1) R h_q (2 d_c + 4); skip-top-k layers move only this) and ``total``."""
    R, p = _check_positive("rows", rows), _check_positive("gpus", gpus)
    out = {"topk_candidates": (p - 1) * R * cfg.index_topk * 8,
           "partial_attention": (p - 1) * R * cfg.num_attention_heads * (2 * cfg.kv_lora_rank + 4)}
    out["total"] = out["topk_candidates"] + out["partial_attention"]
    return out


def comm_tp_over_cp(cfg: DSAConfig, context: int) -> dict[str, float]:
    """TP traffic / CP traffic per layer, which does not depend on p: indexer ``4 S / (c D_I)`` (4096 at
    S = 128K for V3.2), MLA ``2 hidden / 576`` (V3.2: 4 * 7168 / 1152 = 24.9, "about 25x")."""
    S = _check_positive("context", context)
    return {"indexer": float(Fraction(2 * 4 * S, cfg.index_kpool) / (2 * cfg.index_head_dim)),
            "mla": float(Fraction(2 * 2 * cfg.hidden_size, 2 * cfg.kv_cache_dim))}


def memory_gb(cfg: DSAConfig, batch: int, context: int, gpus: int, kv_format: str = "fp8",
              parallel: str = "tp") -> dict[str, Any]:
    """KV cache per GPU in GB (1e9 B) for ``batch`` requests of ``context`` tokens on ``gpus`` GPUs.

    Each request's tokens on a rank are rounded up to whole pages of ``cfg.page_size`` tokens. ``tp``:
    every rank holds the whole KV; ``cp``: each rank holds ``ceil(context / gpus)`` tokens per request
    (see the module docstring). Returns ``mla``, ``indexer``, ``kv_per_gpu`` (their sum) and
    ``kv_all_gpus`` in GB, plus the inputs and ``tokens_per_gpu`` (page-rounded).
    """
    B, S, P = (_check_positive(n, v) for n, v in (("batch", batch), ("context", context), ("gpus", gpus)))
    _check_choice("kv_format", kv_format, MLA_FORMATS)
    _check_choice("parallel", parallel, PARALLEL_MODES)
    tokens = S if parallel == "tp" else math.ceil(S / P)
    pages = B * math.ceil(tokens / cfg.page_size)
    mla = pages * cfg.page_size * _mla_bytes(cfg, kv_format) * cfg.num_hidden_layers
    # An indexer page of 8448 bytes covers the same page_size (= 64 c) tokens as an MLA page.
    indexer = pages * INDEX_PAGE_BYTES * len(cfg.topk_layers)
    return {
        "parallel": parallel, "kv_format": kv_format, "batch": B, "context": S, "gpus": P,
        "tokens_per_gpu": pages * cfg.page_size,
        "mla": mla / 1e9, "indexer": indexer / 1e9, "kv_per_gpu": (mla + indexer) / 1e9,
        "kv_all_gpus": (mla + indexer) * P / 1e9,
    }


def attention_params(cfg: DSAConfig) -> dict[str, int]:
    """Parameters of the attention block over all layers (MLA on every layer, the indexer on indexer layers).

    MLA: q_a_proj hidden*q_lora + q_a_layernorm q_lora + q_b_proj q_lora*h_q*(nope+rope) + kv_a_proj
    hidden*(d_c+d_r) + kv_a_layernorm d_c + kv_b_proj d_c*h_q*(nope+v) + o_proj h_q*v*hidden.
    Indexer: wq_b q_lora*H_I*D_I + wk hidden*D_I + k_norm 2*D_I (LayerNorm with bias) + weights_proj
    hidden*H_I. MoE / MLP, embeddings, norms outside attention and kpool gates are not counted.
    """
    d, h = cfg.hidden_size, cfg.num_attention_heads
    mla = (d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
           + d * cfg.kv_cache_dim + cfg.kv_lora_rank
           + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d)
    D, H = cfg.index_head_dim, cfg.index_n_heads
    indexer = cfg.q_lora_rank * H * D + d * D + 2 * D + d * H
    return {"mla": mla * cfg.num_hidden_layers, "indexer": indexer * len(cfg.topk_layers)}


# ---- the report ------------------------------------------------------------------------------------

def load_config(preset: str | None = None, config: str | os.PathLike | None = None) -> tuple[DSAConfig, str]:
    """The DSAConfig of a preset name or of a ``config.json`` path (or a folder holding one), and its label.

    Neither given: the ``v32`` preset. Raises ValueError for both, an unknown preset, a missing or
    unreadable file, or a config that is not DSA.
    """
    if preset is not None and config is not None:
        raise ValueError("give either --preset or --config, not both")
    if config is None:
        name = "v32" if preset is None else preset
        if name not in PRESETS:
            raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
        return DSAConfig.preset(name), f"preset {name}"
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"config: no such file: {path}")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"config: cannot read {path} as JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"config: expected a JSON object in {path}, got {type(data).__name__}")
    return DSAConfig.from_hf(data), path


def with_kpool(cfg: DSAConfig, kpool: int) -> DSAConfig:
    """``cfg`` with ``index_kpool = kpool``; ValueError naming ``kpool`` (the indexer cache and scan shrink by it)."""
    _check_positive("kpool", kpool)
    try:
        return cfg.replace(index_kpool=kpool)
    except ValueError as e:
        raise ValueError(f"kpool: {str(e).split(': ', 1)[1]}") from None


def plan(cfg: DSAConfig, context: int = DEFAULT_CONTEXT, batch: int = 1, gpus: int = DEFAULT_GPUS,
         kv_format: str = "fp8", parallel: str = "tp", source: str | None = None) -> dict[str, Any]:
    """The whole cost model as one JSON-ready dict (keys as in ``flashdsa plan --json``)."""
    for name, value in (("context", context), ("batch", batch), ("gpus", gpus)):
        _check_positive(name, value)
    _check_choice("kv_format", kv_format, MLA_FORMATS)
    _check_choice("parallel", parallel, PARALLEL_MODES)
    hf_layers = cfg.num_hidden_layers
    cfg = cfg.dsa_stack()  # a hybrid stack's linear-attention layers hold no KV of ours: costed apart, not here
    kv = kv_bytes_per_token(cfg)
    return {
        "config": source,
        "model": {"architecture": cfg.architectures[0], "num_hidden_layers": hf_layers,
                  "dsa_layers": cfg.num_hidden_layers, "nope": cfg.qk_rope_head_dim == 0,
                  "indexer_layers": len(cfg.topk_layers), "index_topk": cfg.index_topk,
                  "index_kpool": cfg.index_kpool, "page_size": cfg.page_size},
        "inputs": {"context": context, "batch": batch, "gpus": gpus, "kv_format": kv_format,
                   "parallel": parallel},
        "kv_bytes_per_token": kv["all_layers"],
        "kv_bytes_per_token_per_layer": kv["per_layer"],
        "indexer_share": indexer_share(cfg, kv_format),
        "flops_per_token": flops_per_token(cfg, context),
        "crossover_context": crossover_context(cfg),
        "crossover_context_all_layers": crossover_context(cfg, all_layers=True),
        "comm_bytes_per_rank_per_layer": comm_bytes_per_rank_per_layer(cfg, context, gpus),
        "comm_tp_over_cp": comm_tp_over_cp(cfg, context),
        "cp_gather_bytes_per_rank_per_layer": cp_gather_bytes_per_rank_per_layer(cfg, context, gpus),
        "dcp_bytes_per_rank_per_layer": dcp_bytes_per_rank_per_layer(cfg, batch, gpus),
        "memory_gb": memory_gb(cfg, batch, context, gpus, kv_format, parallel),
        "attention_params": attention_params(cfg),
        "definitions": DEFINITIONS,
    }


def _si(x: float, unit: str = "", digits: int = 3) -> str:
    """1234567 -> '1.23 M' (decimal prefixes, ``digits`` significant digits, trailing zeros kept)."""
    if x == 0:
        return f"0 {unit}".rstrip()
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:#.{digits}g}".rstrip(".") + f" {prefix}{unit}"
    return (f"{x:#.{digits}g}".rstrip(".") + f" {unit}").rstrip()


def _times(r: float) -> str:
    return f"{r:.1f}x" if r < 1000 else f"{r:.0f}x"


def format_plan(report: dict[str, Any]) -> str:
    """A compact human-readable table of :func:`plan`'s report."""
    m, inp = report["model"], report["inputs"]
    kv, kvl = report["kv_bytes_per_token"], report["kv_bytes_per_token_per_layer"]
    fl, cm, mem = report["flops_per_token"], report["comm_bytes_per_rank_per_layer"], report["memory_gb"]
    ratio = report["comm_tp_over_cp"]
    cpg, dcp = report["cp_gather_bytes_per_rank_per_layer"], report["dcp_bytes_per_rank_per_layer"]
    fmt = inp["kv_format"]
    S, p = inp["context"], inp["gpus"]
    lines = [
        f"flashdsa plan: {m['architecture']} ({report['config']}): {m['num_hidden_layers']} layers"
        + (f" ({m['dsa_layers']} DSA, the rest linear attention: 'all layers' below are the DSA ones)"
           if m["dsa_layers"] != m["num_hidden_layers"] else "")
        + f", {m['indexer_layers']} with an indexer, top-{m['index_topk']}, kpool {m['index_kpool']}"
        + (", NoPE (512-dim rows, no rope part)" if m["nope"] else ""),
        "",
        f"{'KV bytes per token':<26}{'per layer':>12}{'all layers':>14}",
    ]
    rows = [("MLA bf16 (dense)", "bf16"), (f"MLA fp8 ({kvl['mla']['fp8']})", "fp8"),
            (f"MLA fp8_raw ({kvl['mla']['fp8_raw']})", "fp8_raw")]
    for label, f in rows:
        lines.append(f"  {label:<24}{kvl['mla'][f]:>10} B{_si(kv['mla'][f], 'B'):>14}")
    lines.append(f"  {'indexer (indexer layers)':<24}{kvl['indexer']:>10} B{_si(kv['indexer'], 'B'):>14}")
    lines.append(f"  {f'{fmt} + indexer':<24}{kvl['total'][fmt]:>10} B{_si(kv['total'][fmt], 'B'):>14}"
                 f"   indexer share {100 * report['indexer_share']:.1f} %")
    unit = fl["per_history_token"]
    lines += [
        "",
        f"FLOPs per query token, one indexer layer, context {S}:",
        f"  {'indexer':<14}{_si(fl['indexer']):>10}   {_si(unit['indexer'], digits=4)} per history token",
        f"  {'sparse MLA':<14}{_si(fl['sparse_mla']):>10}   {_si(unit['mla'], digits=4)} per attended token"
        f" x min(S, {m['index_topk'] + m['index_kpool'] - 1})",
        f"  {'dense MLA':<14}{_si(fl['dense_mla']):>10}",
        f"  indexer = sparse MLA at context {report['crossover_context']} "
        f"(all layers: {report['crossover_context_all_layers']})",
        "",
        f"Prefill comm per rank per layer, T = S = {S}, p = {p}:",
        f"  {'':<10}{'TP':>12}{'CP':>12}{'TP / CP':>10}",
        f"  {'indexer':<10}{_si(cm['tp_indexer'], 'B'):>12}{_si(cm['cp_indexer'], 'B'):>12}"
        f"{_times(ratio['indexer']):>10}   logits all-reduce vs key all-gather",
        f"  {'MLA':<10}{_si(cm['tp_mla'], 'B'):>12}{_si(cm['cp_mla'], 'B'):>12}"
        f"{_times(ratio['mla']):>10}   o_proj all-reduce vs latent all-gather",
        f"  flashdsa CP  {_si(cpg['total'], 'B')} all-gathered: cache rows {_si(cpg['mla'], 'B')} + fp8 index keys "
        f"{_si(cpg['indexer'], 'B')} (padded to ceil(S/p) tokens a rank)",
        f"  flashdsa DCP {_si(dcp['total'], 'B')} a decode step of {mem['batch']} "
        f"row{'s' if mem['batch'] > 1 else ''}: "
        f"top-k candidates {_si(dcp['topk_candidates'], 'B')} + partial attention {_si(dcp['partial_attention'], 'B')}",
        "",
        f"KV memory per GPU, {mem['batch']} x {mem['context']} tokens on {p} GPU{'s' if p > 1 else ''} "
        f"({mem['parallel']}: "
        + ("whole KV on every GPU" if mem["parallel"] == "tp" else "KV sharded over the GPUs") + f", {fmt}):",
        f"  MLA {_si(mem['mla'] * 1e9, 'B')} + indexer {_si(mem['indexer'] * 1e9, 'B')} = "
        f"{_si(mem['kv_per_gpu'] * 1e9, 'B')}"
        f"   (weights not included)",
    ]
    return "\n".join(lines)

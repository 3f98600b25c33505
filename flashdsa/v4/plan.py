"""``flashdsa plan`` for DeepSeek-V4: what a token costs each layer type in flashdsa's rows, what a query reads
and computes, and a request's cache at a context (issue #43).

Rows as flashdsa stores V4 (the attention core runs on the MLA kernels, flashdsa/v4/attention.py): a window
row or an entry is one MLA row with the K = V head in its 512-dim latent part (bf16 1152 B, fp8 656 B; the
zero rope part costs 64 / 128 B a row that V4's own layouts do not spend), a CSA indexer key one indexer
row (132 B: 128 e4m3 + its scale). The window is a ring of ``sliding_window`` rows a request and layer.
"""

from __future__ import annotations

import os
from typing import Any

from flashdsa.cache.layouts import INDEX_BYTES_PER_TOKEN, MLA_BF16_BYTES, MLA_FP8_BYTES
from flashdsa.config import read_config_json
from flashdsa.v4.config import CSA, HCA, LAYER_TYPES, SLIDING, V4Config, is_v4

ROW_BYTES = {"bf16": MLA_BF16_BYTES, "fp8": MLA_FP8_BYTES}
PRESETS = ("v4-flash",)


def load_v4(preset: str | None, config: str | os.PathLike | None) -> tuple[V4Config, str] | None:
    """The V4Config of a V4 preset or of a V4 ``config.json`` (or its folder) with its label; None when the
    source is not V4 (the DSA plan reads it)."""
    if preset is not None:
        return (V4Config.preset(preset), f"preset {preset}") if preset in PRESETS else None
    if config is None:
        return None
    try:
        data = read_config_json(config)
    except (OSError, ValueError):
        return None  # the DSA loader names the problem
    path = os.path.join(os.fspath(config), "config.json") if os.path.isdir(config) else os.fspath(config)
    return (V4Config.from_hf(data), path) if is_v4(data) else None


def plan_v4(cfg: V4Config, context: int, batch: int = 1, kv_format: str = "fp8", source: str = "") -> dict[str, Any]:
    """Per layer type: layers, bytes a context token costs, keys a query attends to at ``context``, attention and
    indexer FLOPs a query token; the cache of ``batch`` requests at ``context`` tokens over the whole stack."""
    if kv_format not in ROW_BYTES:
        raise ValueError(f"kv_format: expected one of {sorted(ROW_BYTES)} for V4, got {kv_format!r}")
    if context < 1 or batch < 1:
        raise ValueError(f"context, batch: expected positive integers, got {context}, {batch}")
    row = ROW_BYTES[kv_format]
    per_token = {SLIDING: 0.0, CSA: (row + INDEX_BYTES_PER_TOKEN) / cfg.csa_rate, HCA: row / cfg.hca_rate}
    types: dict[str, dict[str, Any]] = {}
    for t in LAYER_TYPES:
        layers = [i for i, lt in enumerate(cfg.layer_types) if lt == t]
        if not layers:
            continue
        keys = cfg.selected_entries(layers[0], context)
        entries = context // cfg.rate(layers[0]) if t != SLIDING else 0
        attn = 2 * cfg.num_attention_heads * 2 * cfg.head_dim * keys  # QK and PV over the listed keys
        index = 2 * cfg.index_n_heads * cfg.index_head_dim * entries if t == CSA else 0
        cache = min(context, cfg.sliding_window) * row + int(per_token[t] * context)
        types[t] = {"layers": len(layers), "bytes_per_token": per_token[t], "keys_per_query": keys,
                    "attention_flops_per_token": attn, "indexer_flops_per_token": index,
                    "cache_bytes_per_request": cache}
    total = sum(v["layers"] * v["cache_bytes_per_request"] for v in types.values())
    return {"model": "DeepseekV4ForCausalLM", "config": source, "kv_format": kv_format, "context": context,
            "batch": batch, "layer_types": types, "cache_bytes": total * batch,
            "cache_bytes_per_token": total / context}


def format_plan_v4(report: dict[str, Any]) -> str:
    """A compact table of :func:`plan_v4`'s report."""
    S, fmt = report["context"], report["kv_format"]
    lines = [f"flashdsa plan: DeepSeek-V4 ({report['config']}), context {S}, batch {report['batch']}, {fmt} rows",
             f"{'layer type':<30} {'layers':>6} {'B/token':>8} {'keys/query':>10} {'attn GFLOP/tok':>14} "
             f"{'indexer GFLOP/tok':>17} {'cache MB/request':>16}"]
    for t, v in report["layer_types"].items():
        lines.append(f"{t:<30} {v['layers']:>6} {v['bytes_per_token']:>8.1f} {v['keys_per_query']:>10} "
                     f"{v['attention_flops_per_token'] / 1e9:>14.3f} {v['indexer_flops_per_token'] / 1e9:>17.3f} "
                     f"{v['cache_bytes_per_request'] / 1e6:>16.2f}")
    lines.append(f"cache, whole stack: {report['cache_bytes'] / 2**30:.2f} GiB for {report['batch']} request(s), "
                 f"{report['cache_bytes_per_token']:.0f} B a context token (window rings included)")
    lines.append("rows: the K = V head in flashdsa's MLA rows (zero rope part), CSA keys in 132-B indexer rows; "
                 "the V4 caches themselves are not built yet (#43)")
    return "\n".join(lines)

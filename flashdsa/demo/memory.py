"""What the demo will hold, estimated before anything is allocated: :func:`memory_estimate` adds up the
weights, the KV pools and the largest activations; :func:`~flashdsa.demo.run_demo` refuses a preset that does
not fit the device (:func:`_fit_message` says how many layers would) and, on a CPU, warns of a long run.
"""

from __future__ import annotations

import os
import time

import torch

from flashdsa.cache.pool import page_bytes
from flashdsa.config import DSAConfig
from flashdsa.demo.scenario import DECODE_STEPS, _scenario, demo_config
from flashdsa.engine import DSAModel

# At most this many KV pools are alive at once (the two prefilled runners of the verify check).
LIVE_POOLS = 2
GB = 1e9


def _weights(cfg: DSAConfig) -> tuple[int, list[int], int]:
    """The demo model's weights, counted on the meta device: bytes outside the layers (embedding, LM head,
    final norm, RoPE tables), bytes per layer, and the parameters that multiply a token's activations
    (every 2-D weight but the embedding, which is a lookup)."""
    with torch.device("meta"):
        model = DSAModel(cfg)

    def size(mod: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in (*mod.parameters(), *mod.buffers()))

    per_layer = [size(layer) for layer in model.layers]
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name)
    return size(model) - sum(per_layer), per_layer, matmul


def _activation_bytes(cfg: DSAConfig, lens: dict[str, int], cuts: list[int], kv_format: str, torch_ops: bool,
                      next_n: int = 2) -> int:
    """The largest activations the demo holds at once, from its biggest terms.

    Each phase holds some [rows, vocab] fp32 logits for a comparison while a forward of ``rows`` tokens
    runs: its LM head makes bf16 logits and their fp32 copy, and one layer's temporaries live meanwhile
    (MLP, the queries before and after absorption, the indexer's fp32 queries and its logits, and
    on the torch reference the dense fallback's fp32 scores of the longest context that fits top-k).
    An extend scores its keys within a 1 GiB budget; the verify step's paged indexer logits ``[B next_n,
    context]`` fp32 come in one piece (on the torch reference with one request's per-head scores beside them).
    """
    V, h, k = cfg.vocab_size, cfg.num_attention_heads, cfg.index_topk
    dense_ok = kv_format != "fp8_raw"
    fit = lens["short"] + lens["at_topk"]
    first = lens["short"] + lens["at_topk"] + cuts[1]
    chunk = max(b - a for a, b in zip(cuts, cuts[1:]))

    def layer(rows: int, keys: int, dense: bool, verify: bool = False) -> int:
        per_row = (3 * 2 * cfg.intermediate_size + 2 * h * (cfg.qk_head_dim + cfg.kv_lora_rank + cfg.kv_cache_dim)
                   + 4 * 2 * cfg.index_n_heads * cfg.index_head_dim + 2 * 4 * cfg.hidden_size)
        scores = 3 * 4 * h * k * k if dense and torch_ops else 0  # scores, mask fill, softmax
        if verify:
            per_head = 4 * rows // B * cfg.index_n_heads * keys if torch_ops else 0  # one request's rows
            return rows * per_row + 4 * rows * keys + per_head
        return rows * per_row + min(1 << 30, 4 * rows * keys) + scores

    B, context = len(lens), lens["long"] + DECODE_STEPS + next_n
    # (logits held for a comparison, rows of the running forward, its keys, the dense path, a verify step)
    phases = [(0, first, lens["at_topk"], dense_ok, False),                  # serving, first chunk
              (0, lens["long"], lens["long"], False, False),                 # the long prompt in one extend
              (lens["long"], chunk, lens["long"], False, False),             # chunked, one-shot logits held
              (fit if dense_ok else 0, fit, lens["at_topk"], False, False),  # sparse, dense logits held
              (0, B * next_n, context, False, True),                         # the verify step
              (3 * B * next_n, B, context, False, True)]  # verify check: verify + decodes' logits (list, stacked)
    return max(4 * held * V + 6 * rows * V + layer(rows, keys, dense, verify)
               for held, rows, keys, dense, verify in phases)


def memory_estimate(cfg: DSAConfig, kv_format: str = "fp8", next_n: int = 2, torch_ops: bool = True) -> dict:
    """What the demo will hold at its peak, in bytes, computed without allocating anything.

    ``weights`` (the model's parameters, counted on the meta device), ``kv`` (LIVE_POOLS pools of the
    scenario's pages at ``flashdsa.cache.pool.page_bytes`` each, the per-page formula of ``flashdsa plan``'s
    memory figure), ``activations`` (:func:`_activation_bytes`) and ``total``. ``torch_ops``: the ops run
    their PyTorch references (the CPU default), whose dense fallback holds its fp32 scores.
    """
    fixed, per_layer, _ = _weights(cfg)
    return _estimate(cfg, kv_format, next_n, torch_ops, fixed + sum(per_layer))


def _estimate(cfg: DSAConfig, kv_format: str, next_n: int, torch_ops: bool, weights: int) -> dict:
    lens, cuts, pages = _scenario(cfg, next_n)
    est = {"weights": weights, "kv": LIVE_POOLS * pages * page_bytes(cfg, kv_format),
           "activations": _activation_bytes(cfg, lens, cuts, kv_format, torch_ops, next_n)}
    est["total"] = sum(est.values())
    return est


def available_memory(device: torch.device) -> int | None:
    """Bytes free for the demo on ``device``: the GPU's free memory, or the host's MemAvailable (None
    where the system does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _fits(est: dict, avail: int) -> bool:
    # The estimate leaves out the allocator's slack and the interpreter itself: keep 10 % headroom.
    return est["total"] * 1.1 <= avail


def _largest_fitting_layers(preset: str, kv_format: str, next_n: int, torch_ops: bool,
                            avail: int, kpool: int | None = None) -> tuple[int, dict]:
    """The most leading layers of ``preset`` whose demo fits ``avail`` bytes (0 if none), and the estimate
    of one layer (the quickest run)."""
    fixed, per_layer, _ = _weights(demo_config(preset, None, kpool))
    est = [_estimate(demo_config(preset, n, kpool), kv_format, next_n, torch_ops, fixed + sum(per_layer[:n]))
           for n in range(1, len(per_layer) + 1)]
    return sum(_fits(e, avail) for e in est), est[0]


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB" if x >= 0.1 * GB else f"{x / GB:.3f} GB"


def _fit_message(preset: str, cfg: DSAConfig, device: torch.device, est: dict, avail: int, kv_format: str,
                 next_n: int, torch_ops: bool) -> str:
    where = "free on the GPU" if device.type == "cuda" else "available in RAM"
    msg = (f"preset: {preset} ({cfg.num_hidden_layers} layers) on {device} needs about {_gb(est['total'])} "
           f"(weights {_gb(est['weights'])}, KV caches {_gb(est['kv'])}, activations {_gb(est['activations'])}) "
           f"but {_gb(avail)} is {where}")
    kpool = cfg.index_kpool if cfg.index_kpool != DSAConfig.preset(preset).index_kpool else None
    layers, one = _largest_fitting_layers(preset, kv_format, next_n, torch_ops, avail, kpool)
    hints = []
    if layers >= 1:
        hints.append(f"--layers N fits for N <= {layers} (--layers 1: about {_gb(one['total'])})")
    else:
        hints.append(f"even --layers 1 needs about {_gb(one['total'])}")
    if next_n > 2:
        hints.append(f"a smaller --next-n ({next_n}: the verify step's logits grow with it)")
    if device.type == "cpu":
        hints.append("a GPU fits more (--device cuda)")
    hints.append("--force runs it anyway")
    return msg + "; " + ", ".join(hints)


def _cpu_matmul_rate() -> float:
    """bf16 matmul FLOP/s of this CPU from one short probe (a rough guide: the rate varies with the shape,
    and from ~1 GFLOP/s on CPUs without bf16 instructions to hundreds with them)."""
    a = torch.randn(128, 1024, dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, dtype=torch.bfloat16)
    a @ b
    t0 = time.perf_counter()
    a @ b
    return 2 * 128 * 1024 * 1024 / max(time.perf_counter() - t0, 1e-9)

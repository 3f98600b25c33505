"""The main job: a DSA model served the way an engine serves it, on paged caches, with its checks.

Builds a model with seeded random weights (a preset's real layer shapes, optionally fewer layers) and
a KV pool, prefills a batch whose prompts straddle the dense/sparse threshold (the longest in chunks),
decodes a few steps, runs one MTP verify step, and checks the promises of the engine:

    dense_equivalence      sparse path vs dense fallback where every context <= index_topk
                           (n/a for the fp8_raw cache, which never takes the dense path)
    chunked_vs_oneshot     the long prompt in chunks vs in one extend (both sparse)
    verify_vs_decode       next_n drafts verified at once vs n sequential decodes
    skip_layers_reuse      skip-top-k layers use the previous layer's selection as is
                           (n/a for a model without skip-top-k layers)
    offload (--offload)    the scenario served with the MLA cache in host memory (flashdsa.cache.offload)
                           vs the same scenario all on the device: bitwise the same logits

With ``kpool`` (``--kpool C``) the model pools every C tokens' index keys into one (docs/DSA.md §7) and the
long prompt's chunks split groups, so chunked_vs_oneshot also checks a group written across two chunks.

A check that does not apply is reported as None (JSON null, "n/a" in the text), never as a number.

Before anything is allocated, :func:`memory_estimate` adds up what the demo will hold (weights, KV
pools, the largest activations) and :func:`run_demo` refuses a preset that does not fit the device.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Callable

import torch

from flashdsa.cache import layouts
from flashdsa.cache.offload import OffloadConfig
from flashdsa.cache.pool import page_bytes
from flashdsa.config import PRESETS, DSAConfig
from flashdsa.engine import DSAModel, Runner

# The checks compare logits of two runs that differ only in how the work was batched. Both sides
# round in bf16, and on a GPU cuBLAS picks other GEMM algorithms for other row counts, so the bits
# differ; random weights then amplify rounding through the layers (and can flip a top-k boundary).
# A real bug (a chunk not seeing its prefix, a draft seeing its future) moves the logits by O(1), so
# ok is judged on the relative RMS error, with the max abs error (relative to the logits' scale)
# reported beside it. The rounding noise grows about linearly with depth (v32 shapes on an H200:
# 0.26-0.40 % RMS after 1 layer, 0.8 % after 2, 1.5-2.0 % after 4), hence a budget per layer.
TOL_RMS_PER_LAYER = 6e-3

KV_FORMATS = layouts.MLA_FORMATS
DECODE_STEPS = 4
# At most this many KV pools are alive at once (the two prefilled runners of the verify check).
LIVE_POOLS = 2
# fp8_raw's per-tensor scale: the latent stays within +-14 after its RMSNorm.
RAW_KV_SCALE = 1 / 32
GB = 1e9


# ---- arguments ---------------------------------------------------------------------------------------

def parse_device(device: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` -> a torch.device that exists here; ValueError otherwise."""
    if not isinstance(device, str):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if kind == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"device: {device!r} requested but torch sees no CUDA device "
                             f"(torch {torch.__version__}); use --device cpu")
        if index and int(index) >= n:
            raise ValueError(f"device: {device!r} requested but torch sees {n} CUDA device{'s' if n > 1 else ''} "
                             f"(cuda:0..cuda:{n - 1})")
    return torch.device(device)


def demo_config(preset: str, layers: int | None = None, kpool: int | None = None) -> DSAConfig:
    """The preset's config, optionally cut to its first ``layers`` layers (skip-top-k rules cut alike) and with
    ``index_kpool = kpool`` (None: the preset's)."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    cfg = DSAConfig.preset(preset)
    if kpool is not None:
        if isinstance(kpool, bool) or not isinstance(kpool, int) or kpool < 1:
            raise ValueError(f"kpool: expected an integer >= 1 (tokens per pooled index key), got {kpool!r}")
        try:
            cfg = cfg.replace(index_kpool=kpool)
        except ValueError as e:  # the config's rule, said of the flag
            raise ValueError(f"kpool: {str(e).split(': ', 1)[1]}") from None
    if layers is None:
        return cfg
    L = cfg.num_hidden_layers
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= L:
        raise ValueError(f"layers: expected 1..{L} (the {preset} preset has {L} layers), got {layers!r}")
    keep = dict(num_hidden_layers=layers)
    if cfg.indexer_types is not None:
        keep["indexer_types"] = cfg.indexer_types[:layers]
    if cfg.index_topk_pattern is not None:
        keep["index_topk_pattern"] = cfg.index_topk_pattern[:layers]
    return cfg.replace(**keep)


def max_next_n(cfg: DSAConfig) -> int:
    """The most drafts the demo's verify step may take: the longest prompt, its decodes and the drafts must
    stay within the model's context (``max_position_embeddings``)."""
    return cfg.max_position_embeddings - max(_scenario(cfg, 1)[0].values()) - DECODE_STEPS


def _check_args(cfg: DSAConfig, device: torch.device, next_n, seed, backend, kv_format) -> None:
    hi = max_next_n(cfg)
    if isinstance(next_n, bool) or not isinstance(next_n, int) or not 1 <= next_n <= hi:
        raise ValueError(f"next_n: expected an integer 1 <= next_n <= {hi} (the longest prompt, its {DECODE_STEPS} "
                         f"decodes and the drafts must fit the model's max_position_embeddings, "
                         f"{cfg.max_position_embeddings}), "
                         f"got {next_n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 62:
        raise ValueError(f"seed: expected an integer in 0..2**62 - 1, got {seed!r}")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format: expected one of {list(KV_FORMATS)}, got {kv_format!r}")
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"backend: expected 'torch', 'triton' or None, got {backend!r}")
    # The ops would refuse this only once the model is built and the first layer runs.
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend: 'triton' needs --device cuda (or TRITON_INTERPRET=1 to interpret the "
                         f"kernels on the CPU, very slowly), got {device}")


# ---- the scenario ------------------------------------------------------------------------------------

def _scenario(cfg: DSAConfig, next_n: int) -> tuple[dict[str, int], list[int], int]:
    """Prompt lengths, the chunk cuts of the long prompt, and the pages of one pool."""
    k = cfg.index_topk
    lens = {"short": k // 2, "at_topk": k, "long": 3 * k + 7}  # straddle the dense/sparse threshold
    cuts = [0, k // 2, 2 * k, lens["long"]]
    if cfg.index_kpool > 1:  # cut inside groups: a group written across two chunks
        cuts = [0, k // 2 + 1, 2 * k + 3, lens["long"]]
    pages = 2 * sum(-(-(n + 2 * DECODE_STEPS + next_n) // cfg.page_size) for n in lens.values()) + 8
    return lens, cuts, pages


def _tokens_processed(lens: dict[str, int], next_n: int) -> int:
    """Tokens the whole demo pushes through the model: warm-up and timed serving, then the checks."""
    B = len(lens)
    serve = sum(lens.values()) + DECODE_STEPS * B + next_n * B
    verify_check = 2 * sum(lens.values()) + 2 * next_n * B  # two prefills, the drafts verified and decoded
    chunked_check = 2 * lens["long"]
    dense_check = 2 * (lens["short"] + lens["at_topk"])
    return 2 * serve + verify_check + chunked_check + dense_check


# ---- memory ------------------------------------------------------------------------------------------

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


# ---- checks ------------------------------------------------------------------------------------------

class _Diff:
    """Relative RMS (``|a - b| / |b|``) and max abs error (``max |a - b| / max(max |b|, 1)``) of ``a`` vs
    ``b``, accumulated over row blocks so [rows, vocab] logits never get full-size temporaries."""

    def __init__(self) -> None:
        self.err_sq = self.ref_sq = self.err_max = self.ref_max = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor, block: int = 256) -> "_Diff":
        a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        for i in range(0, a.shape[0], block):
            d = a[i:i + block].double() - b[i:i + block].double()
            ref = b[i:i + block].double()
            self.err_sq += float(d.square().sum())
            self.ref_sq += float(ref.square().sum())
            self.err_max = max(self.err_max, float(d.abs().max()))
            self.ref_max = max(self.ref_max, float(ref.abs().max()))
        return self

    @property
    def rel_rms(self) -> float:
        return math.sqrt(self.err_sq) / max(math.sqrt(self.ref_sq), 1e-30)

    @property
    def rel_max_abs(self) -> float:
        return self.err_max / max(self.ref_max, 1.0)


def _fmt_check(diff: _Diff | None, why: str = "") -> str:
    return f"n/a ({why})" if diff is None else f"{diff.rel_rms:.2e} | {diff.rel_max_abs:.2e}"


# ---- host offload ------------------------------------------------------------------------------------

def _offload_config(cfg: DSAConfig, offload, device_buffer, next_n: int) -> OffloadConfig | None:
    """The demo's OffloadConfig (None without offload): one device buffer per scenario request, of
    ``device_buffer`` rows (default ``max(2, next_n)`` times the tokens a query row selects, at most the pool's
    tokens), which must hold a verify step's selections and cannot exceed the pool's tokens."""
    if not isinstance(offload, bool):
        raise ValueError(f"offload: expected True or False, got {offload!r}")
    if not offload:
        if device_buffer is not None:
            raise ValueError(f"device_buffer: expected None without offload (it sizes the device buffers of "
                             f"--offload), got {device_buffer!r}")
        return None
    k = cfg.selected_tokens  # the tokens one row selects (kpool: the tail group too)
    page = layouts.PAGE_SIZE
    lens, _, pages = _scenario(cfg, next_n)
    # a verify step's rows select up to next_n * k distinct tokens, never more than their request holds; no
    # request holds more than the pool
    lo, hi = min(next_n * k, max(lens.values()) + DECODE_STEPS + next_n), pages * cfg.page_size
    rows = min(-(-max(2, next_n) * k // page) * page, hi) if device_buffer is None else device_buffer
    if isinstance(rows, bool) or not isinstance(rows, int) or not lo <= rows <= hi or rows % page:
        selects = "index_topk" if cfg.index_kpool == 1 else "(index_topk + index_kpool - 1)"
        raise ValueError(f"device_buffer: expected a multiple of {page} from {lo} (next_n * {selects} = {next_n} * "
                         f"{k}, or the longest request's tokens if fewer: what one verify step of a request may "
                         f"select) to {hi} (the pool's tokens), got {rows!r}")
    return OffloadConfig(device_buffer=rows, max_requests=len(lens))


def _offload_report(off_cfg: OffloadConfig | None, kv_mem: dict, swap: dict | None, diff: _Diff | None,
                    layers: int, requests: int) -> dict:
    """The report's offload keys; without offload the device holds everything and the rest is None."""
    on_device = kv_mem["mla"] + kv_mem["index"] + kv_mem["exact_index"]
    per_step = swap["rows"] / swap["steps"] if swap and swap["steps"] else None
    return {
        "offload": off_cfg is not None, "device_buffer": off_cfg.device_buffer if off_cfg else None,
        "device_kv_bytes": kv_mem["device"] if off_cfg else on_device,
        "host_kv_bytes": kv_mem["host"] if off_cfg else 0, "on_device_kv_bytes": on_device,
        "swap_in_tokens_per_step": per_step,
        "swap_in_tokens_per_layer_request": None if per_step is None else per_step / (layers * requests),
        "max_abs_vs_on_device": None if diff is None else diff.err_max,
    }


class _Lockstep:
    """Stands in for a Runner in the serving scenario: every call runs on both runners, returns the first
    one's logits, and ``diff`` keeps how far the second one's are from them."""

    def __init__(self, first: Runner, second: Runner):
        self.first, self.second, self.diff = first, second, _Diff()

    def __getattr__(self, name: str):
        a, b = getattr(self.first, name), getattr(self.second, name)

        def both(*args, **kw):
            out = a(*args, **kw)
            self.diff.add(b(*args, **kw), out)
            return out
        return both


# ---- the demo ----------------------------------------------------------------------------------------

def _decode_kernel(torch_ops: bool) -> str:
    """The sparse-MLA decode kernel behind the figures: "gluon" where the default dispatch ran the Gluon
    kernel (sm_90), else the backend's."""
    from flashdsa.ops.sparse_mla import gluon_decode_ran
    return "torch" if torch_ops else "gluon" if gluon_decode_ran() else "triton"


def run_demo(preset: str = "tiny", device: str = "cpu", next_n: int = 2, seed: int = 0, backend: str | None = None,
             layers: int | None = None, kv_format: str = "fp8", log: Callable[[str], None] | None = print,
             force: bool = False, offload: bool = False, device_buffer: int | None = None,
             kpool: int | None = None) -> dict:
    """Serve the scenario on a preset model and check it; returns the report (``flashdsa demo --json``).

    ``offload``: serve with the MLA cache in host memory and ``device_buffer`` rows per request and layer
    on the device (:func:`_offload_config`), and check it against the same scenario all on the device.
    ``kpool``: pool every ``kpool`` tokens' index keys into one (docs/DSA.md §7; None: the preset's, 1).

    Raises ValueError naming the argument for a bad one, and for a preset whose :func:`memory_estimate`
    exceeds the device's free memory (unless ``force``: then it only warns).
    """
    log = log or (lambda *_: None)
    dev = parse_device(device)
    cfg = demo_config(preset, layers, kpool)
    _check_args(cfg, dev, next_n, seed, backend, kv_format)
    off_cfg = _offload_config(cfg, offload, device_buffer, next_n)
    torch_ops = (backend or ("triton" if dev.type == "cuda" else "torch")) == "torch"

    fixed, per_layer, matmul_params = _weights(cfg)
    est = _estimate(cfg, kv_format, next_n, torch_ops, fixed + sum(per_layer))
    avail = available_memory(dev)
    fits = None if avail is None else _fits(est, avail)
    if fits is False:
        msg = _fit_message(preset, cfg, dev, est, avail, kv_format, next_n, torch_ops)
        if not force:
            raise ValueError(msg)
        log(f"[demo] warning (--force): {msg}")

    k = cfg.index_topk
    lens, cuts, pages = _scenario(cfg, next_n)
    prompts = {r: torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed + i))
               for i, (r, n) in enumerate(lens.items())}
    stages: dict[str, float] = {}

    def timed(name: str, fn):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        stages[name] = stages.get(name, 0.0) + time.perf_counter() - t0
        return out

    log(f"[demo] {preset}: {cfg.num_hidden_layers} layer{'s' if cfg.num_hidden_layers > 1 else ''} "
        f"({len(cfg.topk_layers)} with an indexer, skip-top-k "
        f"{cfg.skip_topk_layers}), {cfg.num_attention_heads} heads, topk {k}, on {dev}, KV {kv_format}"
        + (f", kpool {cfg.index_kpool} (top-{k // cfg.index_kpool} groups of {cfg.index_kpool} + the tail)"
           if cfg.index_kpool > 1 else ""))
    log(f"[demo] memory estimate {_gb(est['total'])} (weights {_gb(est['weights'])}, KV {_gb(est['kv'])}, "
        f"activations {_gb(est['activations'])}); {'n/a' if avail is None else _gb(avail)} free")
    work = 2 * matmul_params * _tokens_processed(lens, next_n)  # a multiply-add per weight and token
    if dev.type == "cpu" and work > 1e12:
        rate = _cpu_matmul_rate()
        log(f"[demo] about {work / 1e12:.0f} TFLOP of bf16 matmuls: roughly {work / rate / 60:.0f} min at this "
            f"CPU's {rate / 1e9:.1f} GFLOP/s (a GPU takes seconds); Ctrl-C stops it")
    log("[demo] building the model (seeded random weights) ...")
    model = timed("build", lambda: DSAModel.random(cfg, seed=seed, device=dev))

    def runner(offload: OffloadConfig | None = None, **kw) -> Runner:
        # kpool_max_requests: the tail rings of the scenario's requests only (256 by default)
        return Runner(model, pages, kv_format, backend=backend, kpool_max_requests=len(lens),
                      kv_scale=RAW_KV_SCALE if kv_format == "fp8_raw" else None, offload=offload, **kw)

    long = prompts["long"]

    def serve(run: Runner, timed, log) -> tuple[dict, int]:
        """The serving scenario: prefill (short prompts whole, the long one in three chunks), decode a few
        steps greedily, one MTP verify step. Returns the drafts verified and the tokens processed."""
        first = {"short": prompts["short"], "at_topk": prompts["at_topk"], "long": long[cuts[0]:cuts[1]]}
        log(f"[demo] prefill chunk 1/3: {', '.join(f'{r} {len(t)}' for r, t in first.items())} tokens")
        timed("prefill", lambda: run.extend(first))
        for i in (1, 2):
            log(f"[demo] prefill chunk {i + 1}/3: long {cuts[i + 1] - cuts[i]} tokens on top of {cuts[i]}")
            last = timed("prefill", lambda: run.extend({"long": long[cuts[i]:cuts[i + 1]]}))
        tokens = sum(lens.values())
        nxt = {r: int(t) for r, t in zip(lens, [0, 0, int(last[-1].argmax())])}
        for _ in range(DECODE_STEPS):
            logits = timed("decode", lambda: run.decode(nxt))
            nxt = {r: int(row.argmax()) for r, row in zip(lens, logits)}
            tokens += len(lens)
        log(f"[demo] decoded {DECODE_STEPS} steps x {len(lens)} requests")
        drafts = {r: [(t + j) % cfg.vocab_size for j in range(next_n)] for r, t in nxt.items()}
        timed("verify", lambda: run.verify(drafts))
        log(f"[demo] verified {next_n} drafts x {len(lens)} requests")
        return drafts, tokens + next_n * len(lens)

    # The first pass pays one-off costs: Triton compiles each kernel on CUDA (seconds per kernel on a
    # cold cache), and on the CPU torch's first calls pick kernels and grow the allocator. Run the
    # scenario once untimed, on every device, so tokens_per_s measures serving.
    log("[demo] warm-up: the scenario once, untimed (Triton compiles its kernels; first calls) ...")
    timed("warmup", lambda: serve(runner(off_cfg), lambda _name, fn: fn(), lambda *_: None))
    run = runner(off_cfg, record=True)
    drafts, tokens = serve(run, timed, log)
    skip_ok = None
    if cfg.skip_topk_layers:
        skip_ok = all(run.selections[layer] is run.selections[layer - 1] and not run.pool.has_index_cache(layer)
                      for layer in cfg.skip_topk_layers)
    pool_bytes_per_token = run.pool.bytes_per_token()
    kv_mem = run.pool.memory_bytes()
    swap = run.pool.stats.get("decode") if off_cfg else None
    del run

    offload_diff = None
    if off_cfg:
        # The reference takes the sparse path everywhere too (the dense fallback is off with offload), so
        # the two runs do the same math on the same bytes and must agree bit for bit.
        log("[demo] checking: offload vs all on the device ...")
        both = _Lockstep(runner(dense_threshold=0), runner(off_cfg))
        serve(both, lambda _name, fn: fn(), lambda *_: None)
        offload_diff = both.diff
        del both

    # ---- checks ---------------------------------------------------------------------------------
    # Prefills go one request per extend, and comparisons run over row blocks, so the [rows, vocab]
    # logits held at once stay those of one prompt (the memory estimate counts them so).
    log("[demo] checking: verify vs sequential decodes ...")
    ref, verify_ref = runner(), runner()
    for r, p in prompts.items():
        ref.extend({r: p}, force_sparse=True)
        verify_ref.extend({r: p}, force_sparse=True)
    v = verify_ref.verify(drafts)
    d = torch.stack([ref.decode({r: drafts[r][j] for r in lens}) for j in range(next_n)], dim=1)
    verify = _Diff().add(v, d)
    del ref, verify_ref, v, d

    log("[demo] checking: chunked vs one-shot prefill ...")
    one = runner().extend({"long": long}, force_sparse=True)
    chunked, chunk = runner(), _Diff()
    for i in range(3):
        chunk.add(chunked.extend({"long": long[cuts[i]:cuts[i + 1]]}, force_sparse=True), one[cuts[i]:cuts[i + 1]])
    del one, chunked

    # The runner never takes the dense path with an fp8_raw cache, so there is nothing to compare.
    dense, dense_ran, dense_na = None, None, "fp8_raw never takes the dense path"
    if kv_format != "fp8_raw":
        log("[demo] checking: sparse vs dense fallback ...")
        fit = {r: prompts[r] for r in ("short", "at_topk")}
        dense_run = runner(record=True)
        dense_logits = dense_run.extend(fit)
        dense_ran = all(s is None for s in dense_run.selections.values())  # the dense path selects nothing
        dense = _Diff().add(runner().extend(fit, force_sparse=True), dense_logits)
        del dense_run, dense_logits

    total_s = sum(t for name, t in stages.items() if name not in ("build", "warmup"))
    n_index = len(cfg.topk_layers)
    L = cfg.num_hidden_layers
    index_bytes = layouts.INDEX_BYTES_PER_TOKEN * n_index / cfg.index_kpool  # one 132-B key per c tokens
    kv_bytes = {"bf16": layouts.MLA_BF16_BYTES * L, "fp8": layouts.MLA_FP8_BYTES * L,
                "fp8_raw": layouts.MLA_FP8_RAW_BYTES * L, "index": index_bytes,
                "total": pool_bytes_per_token}
    tol = TOL_RMS_PER_LAYER * L
    rms = [c.rel_rms for c in (dense, chunk, verify) if c is not None]
    ok = (max(rms) < tol and skip_ok is not False and dense_ran is not False
          and (offload_diff is None or offload_diff.err_max == 0.0))
    not_applicable = {}
    if dense is None:
        not_applicable["dense_equivalence"] = dense_na
    if skip_ok is None:
        not_applicable["skip_layers_reuse"] = "no skip-top-k layers in this model"
    report = {
        "ok": ok, "device": str(dev), "preset": preset, "layers": L, "kv_format": kv_format, "next_n": next_n,
        "backend": "torch" if torch_ops else "triton", "decode_attention_kernel": _decode_kernel(torch_ops),
        "prompt_lens": list(lens.values()),
        "stages_s": {n: round(t, 4) for n, t in stages.items()}, "tokens_per_s": tokens / total_s,
        "kv_bytes_per_token": kv_bytes, "kpool": cfg.index_kpool, "indexer_bytes_per_token": index_bytes,
        "memory_estimate_gb": {n: round(b / GB, 3) for n, b in est.items()},
        "memory_available_gb": None if avail is None else round(avail / GB, 3),
        "dense_equivalence_max_abs": None if dense is None else dense.rel_max_abs,
        "chunked_vs_oneshot_max_abs": chunk.rel_max_abs, "verify_vs_decode_max_abs": verify.rel_max_abs,
        "dense_equivalence_rel_rms": None if dense is None else dense.rel_rms,
        "chunked_vs_oneshot_rel_rms": chunk.rel_rms, "verify_vs_decode_rel_rms": verify.rel_rms,
        "dense_fallback_ran": dense_ran,
        "skip_layers": cfg.skip_topk_layers, "skip_layers_reuse_exact": skip_ok,
        "not_applicable": not_applicable, "tolerance_rel_rms": tol,
        **_offload_report(off_cfg, kv_mem, swap, offload_diff, L, len(lens)),
    }
    for name, t in stages.items():
        log(f"[demo] {name:<8} {t * 1e3:10.1f} ms")
    log(f"[demo] {tokens} tokens in {total_s:.3f} s: {report['tokens_per_s']:.1f} tokens/s (after the warm-up)")
    log(f"[demo] KV bytes/token (all layers): MLA fp8 {kv_bytes['fp8']} | bf16 {kv_bytes['bf16']} | raw "
        f"{kv_bytes['fp8_raw']} | indexer {kv_bytes['index']:g} | this pool {kv_bytes['total']:.0f}")
    skip_text = ("n/a (no skip-top-k layers)" if skip_ok is None
                 else f"{'exact' if skip_ok else 'BROKEN'} (layers {cfg.skip_topk_layers})")
    log(f"[demo] checks, relative RMS (tolerance {tol:.3g}) | max |diff| / scale: dense equivalence "
        f"{_fmt_check(dense, dense_na)}, chunked vs one-shot {_fmt_check(chunk)}, verify vs decode "
        f"{_fmt_check(verify)}, skip layers reuse {skip_text}")
    if dense_ran is False:
        log("[demo] the dense fallback did not run where every context fits top-k")
    if off_cfg:
        r = report
        log(f"[demo] offload: device KV {r['device_kv_bytes'] / 2**20:.2f} MiB (indexer caches, "
            f"{off_cfg.max_requests} buffers x {off_cfg.device_buffer} rows per layer, resident map), host KV "
            f"{r['host_kv_bytes'] / 2**20:.2f} MiB; all on the device {r['on_device_kv_bytes'] / 2**20:.2f} MiB")
        same = "bitwise the same" if r["max_abs_vs_on_device"] == 0 else "DIFFERENT"
        log(f"[demo] offload: swap-in {r['swap_in_tokens_per_step']:.1f} tokens per decode step "
            f"({r['swap_in_tokens_per_layer_request']:.1f} per layer and request), max |offload - on device| "
            f"{r['max_abs_vs_on_device']:.3g} ({same})")
    log(f"[demo] {'ok' if ok else 'FAILED'}")
    return report


# ---- context parallelism ---------------------------------------------------------------------------------

PARALLEL_MODES = ("cp", "dcp")


def _drive(run: Runner, steps: list[tuple[str, dict]]) -> tuple[list[torch.Tensor], list[dict | None]]:
    """Run ``steps`` (mode, {request: token ids}) through ``run``: each step's logits and the bytes the rank
    received in it (the batch plan's ``traffic``; None without one)."""
    logits, traffic = [], []
    with torch.no_grad():
        for mode, chunks in steps:
            meta, reservation = run.prepare({r: len(t) for r, t in chunks.items()}, mode, force_sparse=True)
            try:
                logits.append(run.forward(torch.cat(list(chunks.values())).to(run.pool.device), meta))
            except BaseException:
                run.undo(reservation)
                raise
            traffic.append(None if meta.parallel is None else meta.parallel.traffic)
    return logits, traffic


def run_parallel_demo(mode: str, world: int, split: str = "zigzag", preset: str = "tiny", device: str = "cpu",
                      next_n: int = 2, seed: int = 0, backend: str | None = None, layers: int | None = None,
                      kv_format: str = "fp8", log: Callable[[str], None] | None = print,
                      kpool: int | None = None) -> dict:
    """The demo's scenario on ``world`` ranks (one process each, under torchrun), checked against one process.

    ``mode`` "cp" (prefill CP, ``split`` "interleave" | "zigzag") or "dcp" (decode CP: the KV sharded). Every
    rank also runs the scenario as one process, recording each layer's input, selection and output; the
    parallel run then gets each layer's recorded input and must select bitwise the same tokens and stay
    within the bound of :mod:`flashdsa.parallel.check` (CP: equal) — layer by layer, on equal inputs. A free
    run gives the logits' distance to one process (DCP's bf16 partials can flip a later layer's near tie,
    so that number is reported, not judged), the bytes each rank all-gathered per layer (to agree with
    ``flashdsa plan``) and that every rank ended with the same logits. Only rank 0 logs; every rank returns
    the same report. ``kpool`` as in :func:`run_demo` (prefill CP only: it gathers the keys before pooling).
    """
    from flashdsa import plan as cost
    from flashdsa.parallel import ContextParallel, DecodeContextParallel, SPLITS, check, init

    if mode not in PARALLEL_MODES:
        raise ValueError(f"mode: expected one of {PARALLEL_MODES}, got {mode!r}")
    # 1 is meaningful: one rank runs the parallel code path (its overhead, BENCHMARKS.md)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"{mode}: expected an integer >= 1 (ranks, one process each under torchrun), got {world!r}")
    if mode == "cp" and split not in SPLITS:
        raise ValueError(f"cp_split: expected one of {SPLITS}, got {split!r}")
    dev = parse_device(device)
    cfg = demo_config(preset, layers, kpool)
    if mode == "dcp" and cfg.index_kpool > 1:
        raise ValueError(f"kpool: decode context parallelism (--dcp) with kpool is not built (a pooled group's "
                         f"tokens would sit on several ranks); --cp supports it, got kpool {cfg.index_kpool}")
    _check_args(cfg, dev, next_n, seed, backend, kv_format)
    if "WORLD_SIZE" not in os.environ:
        raise ValueError(f"{mode}: expected one process per rank: torchrun --nproc-per-node {world} -m flashdsa "
                         f"demo --{mode} {world} ... (no torchrun environment here)")
    if world != int(os.environ["WORLD_SIZE"]):
        raise ValueError(f"{mode}: expected the number of processes torchrun started ({os.environ['WORLD_SIZE']}), "
                         f"got {world}")
    comm = init(dev)
    dev = comm.device
    rank0 = comm.rank == 0
    log = (log or (lambda *_: None)) if rank0 else (lambda *_: None)
    lens, cuts, pages = _scenario(cfg, next_n)
    gen = torch.Generator().manual_seed(seed)
    prompts = {r: torch.randint(0, cfg.vocab_size, (n,), generator=gen) for r, n in lens.items()}
    what = f"prefill CP, split {split}" if mode == "cp" else "DCP, KV sharded by position"
    log(f"[demo] {preset}: {cfg.num_hidden_layers} layers on {world} rank{'s' if world > 1 else ''} ({what}), "
        f"{dev}, KV {kv_format}, prompts {list(lens.values())}"
        + (f", kpool {cfg.index_kpool}" if cfg.index_kpool > 1 else ""))
    model = DSAModel.random(cfg, seed=seed, device=dev)

    def runner(parallel=None) -> Runner:
        return Runner(model, pages, kv_format, backend=backend, parallel=parallel,
                      kv_scale=RAW_KV_SCALE if kv_format == "fp8_raw" else None, record=True)

    # One process first, greedily, which fixes every step's tokens for the parallel runs.
    long = prompts["long"]
    steps = [("extend", {"short": prompts["short"], "at_topk": prompts["at_topk"], "long": long[cuts[0]:cuts[1]]})]
    steps += [("extend", {"long": long[cuts[i]:cuts[i + 1]]}) for i in (1, 2)]
    one = runner()
    with check.trace(model) as one_trace:
        one_logits, _ = _drive(one, steps)
        nxt = {r: 0 for r in lens} | {"long": int(one_logits[-1][-1].argmax())}
        for _ in range(DECODE_STEPS):
            step = ("decode", {r: torch.tensor([t]) for r, t in nxt.items()})
            steps.append(step)
            (logits,), _ = _drive(one, [step])
            one_logits.append(logits)
            nxt = {r: int(row.argmax()) for r, row in zip(lens, logits)}
        steps.append(("target_verify", {r: torch.tensor([(t + j) % cfg.vocab_size for j in range(next_n)])
                                        for r, t in nxt.items()}))
        one_logits += _drive(one, steps[-1:])[0]
    max_v = check.max_values(one.pool, list(lens))
    log(f"[demo] one process: {len(steps)} steps ({len(steps) - DECODE_STEPS - 1} prefill chunks, {DECODE_STEPS} "
        f"decodes, a verify of {next_n}); now on {world} ranks, every layer fed one process's input ...")

    par = ContextParallel(comm, split) if mode == "cp" else DecodeContextParallel(comm)
    with check.trace(model, check.inputs_only(one_trace)) as par_trace:
        _drive(runner(par), steps)
    layerwise = check.compare(one_trace, par_trace, max_v, cfg.index_topk)
    log("[demo] ... and free-running")
    free = runner(par)
    t0 = time.perf_counter()
    par_logits, traffic = _drive(free, steps)
    elapsed = time.perf_counter() - t0
    logits_max_abs = max(float((a - b).abs().max()) for a, b in zip(par_logits, one_logits))
    digest = hashlib.sha256(torch.cat([t.flatten() for t in par_logits]).cpu().numpy().tobytes()).hexdigest()
    ranks_agree = len(set(comm.all_gather_object(digest, "the logits' digests"))) == 1
    skip_ok = all(free.selections[layer] is free.selections[layer - 1] for layer in cfg.skip_topk_layers) \
        if cfg.skip_topk_layers else None

    # Bytes per rank per layer: CP in the first prefill batch, DCP in the first decode step, both in layer 0
    # (a layer with an indexer), against the cost model's figures for the same tokens and ranks.
    if mode == "cp":
        t = sum(len(c) for c in steps[0][1].values())
        measured = {k: traffic[0][k][0] for k in ("mla", "indexer")}
        planned = cost.cp_gather_bytes_per_rank_per_layer(cfg, t, world)
        at = f"prefill of {t} tokens"
    else:
        first = next(i for i, (m, _) in enumerate(steps) if m == "decode")
        measured = {k: traffic[first][k][0] for k in ("topk_candidates", "partial_attention")}
        planned = cost.dcp_bytes_per_rank_per_layer(cfg, len(lens), world)
        at = f"decode step of {len(lens)} rows"
    measured["total"] = sum(measured.values())
    bytes_agree = measured == planned
    ok = (layerwise["selections_equal"] and layerwise["worst_over_tolerance"] <= 1.0 and ranks_agree and bytes_agree
          and skip_ok is not False)
    report = {
        "ok": ok, "mode": mode, "world_size": world, "split": split if mode == "cp" else "kv-by-position",
        "device": str(dev), "preset": preset, "layers": cfg.num_hidden_layers, "kv_format": kv_format,
        "next_n": next_n, "backend": backend or ("triton" if dev.type == "cuda" else "torch"),
        "kpool": cfg.index_kpool, "prompt_lens": list(lens.values()), "steps": len(steps),
        "selections_bitwise_equal": layerwise["selections_equal"], "layers_compared": layerwise["layers"],
        "selection_mismatches": layerwise["mismatches"],
        "max_abs_vs_single_process": layerwise["max_abs"],
        "max_abs_over_tolerance": layerwise["worst_over_tolerance"],
        "logits_max_abs_vs_single_process_free_running": logits_max_abs, "ranks_agree": ranks_agree,
        "skip_layers_reuse_exact": skip_ok,
        "bytes_all_gathered_per_rank_per_layer": measured, "plan_bytes_per_rank_per_layer": planned,
        "bytes_measured_at": at, "bytes_agree_with_plan": bytes_agree,
        "hidden_bytes_gathered_per_prefill": traffic[0].get("hidden", [0])[0] if mode == "cp" else 0,
        "seconds_free_run": round(elapsed, 4),
    }
    log(f"[demo] layer by layer on one process's inputs ({layerwise['layers']} layer-steps): selections "
        f"{'bitwise equal' if layerwise['selections_equal'] else 'DIFFERENT'}, max |out - one process| "
        f"{layerwise['max_abs']:.3g} = {layerwise['worst_over_tolerance']:.2f} x the bound")
    log(f"[demo] free-running logits: max |diff| {logits_max_abs:.3g} vs one process; ranks agree: {ranks_agree}")
    log(f"[demo] bytes per rank per layer ({at}): {measured} | plan {planned}: "
        f"{'agree' if bytes_agree else 'DISAGREE'}")
    log(f"[demo] {'ok' if ok else 'FAILED'}")
    return report

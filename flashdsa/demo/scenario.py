"""What the demo serves and how it is asked for: the arguments (device, preset, layers, kpool, next_n, ...),
the scenario (prompt lengths straddling the dense/sparse threshold, the chunk cuts of the long prompt, the
pages of one pool) and, with ``--offload``, the device buffers.
"""

from __future__ import annotations

import os

import torch

from flashdsa.cache import layouts
from flashdsa.cache.offload import OffloadConfig
from flashdsa.config import PRESETS, DSAConfig

KV_FORMATS = layouts.MLA_FORMATS
DECODE_STEPS = 4
# fp8_raw's per-tensor scale: the latent stays within +-14 after its RMSNorm.
RAW_KV_SCALE = 1 / 32


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
    """The preset's DSA layers (``dsa_stack``), optionally cut to the first ``layers`` of them (skip-top-k
    rules cut alike) and with ``index_kpool = kpool`` (None: the preset's)."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    cfg = DSAConfig.preset(preset).dsa_stack()  # GLM-5.3-Flash: its DSA layers (the engine runs no KDA)
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

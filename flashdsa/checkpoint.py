"""Load the attention layers of a Hugging Face DeepSeek-V3.2 / GLM-5 checkpoint, a range of layers at a time.

The full models are far larger than one GPU; the attention of a few layers is not (V3.2: ~190 MB per
layer in bf16). The loader reads exactly those layers' tensors from the published layout::

    DIR/config.json                      architectures, the MLA / indexer sizes, index_topk, quantization_config
    DIR/model.safetensors.index.json     {"weight_map": {tensor name: shard file}, "metadata": {...}}
    DIR/model-00001-of-000NN.safetensors the shards (or one DIR/model.safetensors for a small model)

Per layer i, with ``p = "model.layers.{i}."`` (GLM-5.3-Flash, a multimodal model:
``"model.language_model.layers.{i}."``, and only the DSA layers of its hybrid stack; h heads, H_I indexer heads,
D = index_head_dim)::

    p input_layernorm.weight                    [hidden]
    p self_attn.q_a_proj.weight                 [q_lora_rank, hidden]                 fp8 or bf16
    p self_attn.q_a_layernorm.weight            [q_lora_rank]
    p self_attn.q_b_proj.weight                 [h (qk_nope + qk_rope), q_lora_rank]  fp8 or bf16
    p self_attn.kv_a_proj_with_mqa.weight       [kv_lora_rank + qk_rope, hidden]      fp8 or bf16
    p self_attn.kv_a_layernorm.weight           [kv_lora_rank]
    p self_attn.kv_b_proj.weight                [h (qk_nope + v), kv_lora_rank]       fp8 or bf16
    p self_attn.o_proj.weight                   [hidden, h v]                         fp8 or bf16
  top-k layers only (a skip-top-k / "shared" layer has no indexer):
    p self_attn.indexer.wq_b.weight             [H_I D, q_lora_rank]                  fp8 or bf16
    p self_attn.indexer.wk.weight               [D, hidden]                           fp8 or bf16
    p self_attn.indexer.k_norm.weight, .bias    [D]
    p self_attn.indexer.weights_proj.weight     [H_I, hidden]                         bf16
  kpool (index_kpool = c > 1), required by the layer's indexer (and handed back as is in ``kpool``):
    p self_attn.indexer.index_kpool_compress_gate   [D, hidden]
    p self_attn.indexer.index_kpool_compress_ape    [c, D]

An fp8 weight (``float8_e4m3fn``, DeepSeek's ``quantization_config.weight_block_size = [128, 128]``)
comes with ``<name>_scale_inv`` (``...weight_scale_inv``): one fp32 (or UE8M0) factor per 128 x 128
block, ``[ceil(rows / 128), ceil(cols / 128)]`` — despite the name, the factor to MULTIPLY by::

    W[r, c] = float(W_fp8[r, c]) * scale_inv[r // 128, c // 128]        (fp32, then rounded to dtype)

It is dequantised on load (DeepSeek's ``weight_dequant``), on the target device. Norm weights load as
fp32 (exact), ``weights_proj`` as fp32 (HF keeps it in fp32, DeepSeek's inference too), the other
linear weights in ``dtype`` (bf16 by default).

Only the shards that hold a wanted tensor are opened, memory-mapped (safetensors ``safe_open``), and
each tensor is read, dequantised and moved on its own, so memory stays near the size of the chosen
layers. Everything is checked before the first tensor is read: the config is DSA, every tensor is in
the index, every shard exists, is safetensors and holds what the index says, every shape matches the
config. Each tensor read must be finite (no NaN or inf).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from flashdsa.config import DSAConfig, read_config_json
from flashdsa.layers import DSAAttention

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"                   # "<...>.weight" + this = its block scales
FP8_DTYPES = ("F8_E4M3",)                     # safetensors' name of float8_e4m3fn
BLOCK = (128, 128)                            # DeepSeek's default weight_block_size
_MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_MLA_NORMS = ("q_a_layernorm", "kv_a_layernorm")
_KPOOL_PREFIX = "self_attn.indexer.index_kpool_"
_QUANT_METHODS = ("fp8",)
# A load smaller than this finishes before a progress line would be read.
_PROGRESS_MIN_BYTES = 64 << 20
_DEQUANT_BYTES = 64 << 20     # fp32 temporaries of one band of dequantised rows


@dataclass(frozen=True)
class LoadedLayers:
    """What :func:`load_layers` returns.

    ``attention[i]``: the :class:`~flashdsa.layers.DSAAttention` of layer i (``layer_id = i``, checkpoint
    weights, eval mode, no grad); ``input_layernorm[i]``: its RMSNorm weight ``[hidden] float32``;
    ``kpool[i]``: the layer's kpool tensors by name suffix (``"compress_gate"``, ``"compress_ape"``),
    empty when the checkpoint has none. ``source``: the folder; ``shards``: the shard files opened;
    ``hf_config``: the checkpoint's ``config.json`` as read.
    """

    config: DSAConfig
    attention: dict[int, DSAAttention]
    input_layernorm: dict[int, torch.Tensor]
    kpool: dict[int, dict[str, torch.Tensor]]
    source: str
    shards: tuple[str, ...]
    hf_config: dict = field(repr=False, default_factory=dict)

    @property
    def layers(self) -> list[int]:
        return sorted(self.attention)


@dataclass(frozen=True)
class _Tensor:
    """One tensor to read: its checkpoint name, the shape the config implies, where it goes."""

    name: str
    shape: tuple[int, ...]
    layer: int
    target: str          # "attn:<parameter name>", "input_layernorm", "kpool:<suffix>"
    dtype: torch.dtype   # what it is stored as after loading
    linear: bool         # a projection weight: may be fp8 with block scales


# ---- arguments ---------------------------------------------------------------------------------------

def parse_layers(spec: str | int | Iterable[int], num_layers: int) -> list[int]:
    """``"A-B"`` (inclusive), ``"A"``, an int or a sequence of ints -> sorted layer ids in ``[0, num_layers)``.

    ValueError naming ``layers`` for anything else.
    """
    what = f"'A-B' or 'A' with 0 <= A <= B < {num_layers} (num_hidden_layers)"
    if isinstance(spec, str):
        parts = spec.strip().split("-")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"layers: expected {what}, got {spec!r}")
        a, b = int(parts[0]), int(parts[-1])
        if a > b:
            raise ValueError(f"layers: expected {what}, got {spec!r} (A > B)")
        ids = list(range(a, b + 1))
    elif isinstance(spec, int) and not isinstance(spec, bool):
        ids = [spec]
    else:
        try:
            ids = list(spec)
        except TypeError:
            raise ValueError(f"layers: expected {what}, got {spec!r}") from None
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ValueError(f"layers: expected {what} or a non-empty list of ints, got {spec!r}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layers: expected {what}, got {bad[:4]} out of range")
    return sorted(set(ids))


def read_hf_config(checkpoint: str | os.PathLike) -> tuple[dict, DSAConfig]:
    """``DIR/config.json`` -> (the dict, its :class:`DSAConfig`). FileNotFoundError without the file;
    ValueError naming the checkpoint when it is not JSON, not DSA, or quantized in a way we cannot read."""
    root = os.fspath(checkpoint)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"checkpoint: {root} is not a folder (expected a Hugging Face model folder)")
    path = os.path.join(root, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint: {path} is missing (every Hugging Face model folder has one)")
    hf = read_config_json(path, "checkpoint")  # json.load: a dict
    try:
        cfg = DSAConfig.from_hf(hf)
    except ValueError as e:
        raise ValueError(f"checkpoint: {root} is not a DSA checkpoint flashdsa can read: {e}") from None
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method")
        if method not in _QUANT_METHODS:
            raise ValueError(f"checkpoint: {path}: quantization_config.quant_method {method!r} is not supported "
                             f"(expected {list(_QUANT_METHODS)}: fp8 weights with block scales, or none: bf16)")
    if hf.get("attention_bias"):
        raise ValueError(f"checkpoint: {path}: attention_bias is true; flashdsa's DSAAttention has no biases")
    return hf, cfg


def _block(hf: dict) -> tuple[int, int]:
    size = (hf.get("quantization_config") or {}).get("weight_block_size") or BLOCK
    if len(size) != 2 or not all(isinstance(b, int) and b > 0 for b in size):
        raise ValueError(f"checkpoint: quantization_config.weight_block_size: expected [rows, cols], got {size!r}")
    return int(size[0]), int(size[1])


def weight_map(checkpoint: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> shard file name, from ``model.safetensors.index.json`` (or one ``model.safetensors``)."""
    root = os.fspath(checkpoint)
    index = os.path.join(root, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                wm = json.load(f).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"checkpoint: {index} is not a safetensors index ({e})") from None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ValueError(f"checkpoint: {index}: expected a 'weight_map' object of tensor name -> shard file")
        return wm
    single = os.path.join(root, SINGLE_FILE)
    if os.path.isfile(single):
        with _open(single) as f:
            return {name: SINGLE_FILE for name in f.keys()}
    raise FileNotFoundError(f"checkpoint: {root} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def _open(path: str):
    """``safe_open`` of a shard; a file that is not safetensors (truncated, empty, another format) is a ValueError
    naming it instead of safetensors' own error, which does not."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as e:
        raise ValueError(f"checkpoint: {path} is not a readable safetensors file ({e}); is it truncated or "
                         f"corrupt? (re-download it)") from None


# ---- what to read ------------------------------------------------------------------------------------

# Where the decoder layers' tensors live: a causal LM's ``model.layers``, or a multimodal model's language model
# (GLM-5.3-Flash, transformers' Glm5NextForConditionalGeneration: ``model.language_model.layers``)
_LAYER_PREFIXES = ("model.layers.", "model.language_model.layers.")


def _layer_prefix(names) -> str:
    """The prefix of the checkpoint's decoder layers (:data:`_LAYER_PREFIXES`): the one its weight map uses."""
    for prefix in reversed(_LAYER_PREFIXES):
        if any(n.startswith(prefix) for n in names):
            return prefix
    return _LAYER_PREFIXES[0]  # nothing matches: the missing-tensor error names the usual layout


def _expected(cfg: DSAConfig, layer: int, dtype: torch.dtype, names: dict[str, str],
              prefix: str = _LAYER_PREFIXES[0]) -> list[_Tensor]:
    """The tensors of one layer, with the shapes ``cfg`` implies (kpool tensors only when in ``names``)."""
    h, nope, rope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    hid, ql, kl = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
    p = f"{prefix}{layer}."
    f32 = torch.float32
    shapes = {"q_a_proj": (ql, hid), "q_b_proj": (h * (nope + rope), ql), "kv_a_proj_with_mqa": (kl + rope, hid),
              "kv_b_proj": (h * (nope + v), kl), "o_proj": (hid, h * v)}
    out = [_Tensor(p + "input_layernorm.weight", (hid,), layer, "input_layernorm", f32, False)]
    out += [_Tensor(f"{p}self_attn.{m}.weight", shapes[m], layer, f"attn:{m}.weight", dtype, True) for m in _MLA_LINEARS]
    out += [_Tensor(f"{p}self_attn.{m}.weight", (ql if m == "q_a_layernorm" else kl,), layer, f"attn:{m}.weight", f32,
                    False) for m in _MLA_NORMS]
    if layer in cfg.topk_layers:
        H, D = cfg.index_n_heads, cfg.index_head_dim
        ix = p + "self_attn.indexer."
        out += [_Tensor(ix + "wq_b.weight", (H * D, ql), layer, "attn:indexer.wq_b.weight", dtype, True),
                _Tensor(ix + "wk.weight", (D, hid), layer, "attn:indexer.wk.weight", dtype, True),
                _Tensor(ix + "k_norm.weight", (D,), layer, "attn:indexer.k_norm.weight", f32, False),
                _Tensor(ix + "k_norm.bias", (D,), layer, "attn:indexer.k_norm.bias", f32, False),
                # fp32 as HF (_keep_in_fp32_modules) and DeepSeek's inference keep it: the gate is small
                _Tensor(ix + "weights_proj.weight", (H, hid), layer, "attn:indexer.weights_proj.weight", f32, True)]
        kpool = {"compress_gate": (cfg.index_head_dim, hid), "compress_ape": (cfg.index_kpool, cfg.index_head_dim)}
        for suffix, shape in kpool.items():
            name = p + _KPOOL_PREFIX + suffix
            if name in names:
                out.append(_Tensor(name, shape, layer, f"kpool:{suffix}", f32, False))
    return out


def _check_index(root: str, wanted: list[_Tensor], wm: dict[str, str]) -> dict[str, list[str]]:
    """Shard file -> the wanted names (tensors and scales) it holds; errors for anything missing."""
    missing = [t.name for t in wanted if t.name not in wm]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint: tensor {missing[0]!r}{more} is not in {root}'s weight map "
                         f"({INDEX_FILE}): the checkpoint does not match its config.json")
    by_shard: dict[str, list[str]] = {}
    for t in wanted:
        for name in (t.name, t.name + SCALE_SUFFIX):
            if name in wm:
                by_shard.setdefault(wm[name], []).append(name)
    for shard, names in by_shard.items():
        if not os.path.isfile(os.path.join(root, shard)):
            raise FileNotFoundError(f"checkpoint: shard {os.path.join(root, shard)} is missing (it holds "
                                    f"{names[0]!r}{f' and {len(names) - 1} more wanted tensors' if len(names) > 1 else ''})")
    return by_shard


def _check_tensor(t: _Tensor, handle, shard: str, scale, scale_shard: str | None, block: tuple[int, int]) -> int:
    """Shape / dtype / scale checks of one tensor from its shard header; returns the bytes it occupies there."""
    sl = handle.get_slice(t.name)
    shape, dt = tuple(sl.get_shape()), sl.get_dtype()
    if shape != t.shape:
        raise ValueError(f"checkpoint: {t.name}: expected shape {list(t.shape)} from config.json, got {list(shape)} "
                         f"in {shard}")
    nbytes = math.prod(shape) * _DTYPE_BYTES.get(dt, 4)
    fp8 = dt in FP8_DTYPES
    if fp8 and not t.linear:
        raise ValueError(f"checkpoint: {t.name}: stored as {dt}, expected a float dtype (only projection weights "
                         f"are fp8)")
    if fp8 and scale is None:
        raise ValueError(f"checkpoint: {t.name} is {dt} but {t.name + SCALE_SUFFIX!r} is missing (its block scales)")
    if not fp8 and dt not in _FLOAT_DTYPES:
        raise ValueError(f"checkpoint: {t.name}: stored as {dt}, expected one of {sorted(_FLOAT_DTYPES)} or F8_E4M3")
    if scale is not None:
        if not fp8:
            raise ValueError(f"checkpoint: {t.name} has block scales but is stored as {dt}, not F8_E4M3")
        ss = scale.get_slice(t.name + SCALE_SUFFIX)
        want = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        if tuple(ss.get_shape()) != want:
            raise ValueError(f"checkpoint: {t.name + SCALE_SUFFIX}: expected shape {list(want)} (one scale per "
                             f"{block[0]} x {block[1]} block of {list(shape)}), got {list(ss.get_shape())} in {scale_shard}")
        nbytes += math.prod(want) * _DTYPE_BYTES.get(ss.get_dtype(), 4)
    return nbytes


_FLOAT_DTYPES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}
_DTYPE_BYTES = {**_FLOAT_DTYPES, "F8_E4M3": 1, "F8_E8M0": 1}


# ---- dequantisation ----------------------------------------------------------------------------------

def dequant_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-scaled fp8 weight -> ``dtype``.

    Args:
        weight:    ``[R, C] float8_e4m3fn``.
        scale_inv: ``[ceil(R / b0), ceil(C / b1)]`` float32 (or float8_e8m0fnu): the factor of each block.
        block:     ``(b0, b1)``, the block's rows and columns.

    Returns ``[R, C] dtype``: ``float(weight[r, c]) * scale_inv[r // b0, c // b1]`` in fp32, then rounded.
    """
    R, C = weight.shape
    b0, b1 = block
    out = torch.empty(R, C, dtype=dtype, device=weight.device)
    # In bands of whole block rows, so the fp32 temporaries stay near _DEQUANT_BYTES instead of 3x the weight
    # in fp32 (V3.2's o_proj: 1.4 GB for a 235 MB bf16 result).
    band = max(1, _DEQUANT_BYTES // (8 * C * b0)) * b0
    for r0 in range(0, R, band):
        r1 = min(R, r0 + band)
        # [r1 - r0, C] fp32 scales: each block row's factors repeated over its rows and columns
        s = scale_inv[r0 // b0: -(-r1 // b0)].float().repeat_interleave(b0, 0)[: r1 - r0].repeat_interleave(b1, 1)[:, :C]
        out[r0:r1] = weight[r0:r1].float().mul_(s)
    return out


# ---- progress ----------------------------------------------------------------------------------------

class _Progress:
    """A ``\\r``-rewritten line on stderr: what is loaded, out of how much (no dependency, no thread)."""

    def __init__(self, label: str, total: int, enabled: bool, stream=None):
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.stream = stream or sys.stderr
        self.done, self.last = 0, 0.0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.2 or self.done >= self.total):
            self.last = now
            self.stream.write(f"\r{self.label}: {100 * self.done / self.total:5.1f}% "
                              f"({self.done / 1e9:.2f} / {self.total / 1e9:.2f} GB)")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


# ---- the loader --------------------------------------------------------------------------------------

def load_layers(checkpoint: str | os.PathLike, layers: str | int | Sequence[int], *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.bfloat16, progress: bool | None = None) -> LoadedLayers:
    """Read the attention (and input RMSNorm) weights of ``layers`` from a Hugging Face checkpoint folder.

    Args:
        checkpoint: the model folder (``config.json`` + ``model.safetensors.index.json`` + shards).
        layers:     ``"A-B"`` (inclusive), ``"A"``, an int or a sequence of layer ids.
        device:     where the modules live; fp8 weights are dequantised there.
        dtype:      the projection weights' dtype (bf16 or fp32); norms and ``weights_proj`` are fp32.
        progress:   a progress line on stderr; None = when stderr is a terminal and the load is > 64 MB.

    Returns a :class:`LoadedLayers`. Raises FileNotFoundError for a missing folder, ``config.json``, index
    or shard (naming it), ValueError for a non-DSA config, a shard that is not safetensors, a missing tensor
    (naming it), a shape that does not match the config, an fp8 weight without its scales — all before any
    tensor is read — and for a tensor holding NaN or inf once read (naming it and its shard).
    """
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")
    root = os.fspath(checkpoint)
    hf, cfg = read_hf_config(root)
    ids = parse_layers(layers, cfg.num_hidden_layers)
    if cfg.layer_types is not None:  # a hybrid stack: only its DSA layers are flashdsa's
        other = [i for i in ids if i not in cfg.dsa_layers]
        if other:
            raise ValueError(f"layers: layer {other[0]} is a {cfg.layer_types[other[0]]} layer; flashdsa loads the "
                             f"DSA layers of this hybrid stack only: {cfg.dsa_layers}")
    block = _block(hf)
    wm = weight_map(root)
    names = set(wm)
    prefix = _layer_prefix(names)
    wanted = [t for i in ids for t in _expected(cfg, i, dtype, names, prefix)]
    by_shard = _check_index(root, wanted, wm)
    device = torch.device(device)
    with contextlib.ExitStack() as stack:
        handles = {s: stack.enter_context(_open(os.path.join(root, s))) for s in sorted(by_shard)}
        for shard, held in by_shard.items():
            keys = set(handles[shard].keys())
            absent = [n for n in held if n not in keys]
            if absent:
                raise ValueError(f"checkpoint: {INDEX_FILE} puts {absent[0]!r} in {shard}, which does not hold it")
        total = 0
        for t in wanted:
            scale_name = t.name + SCALE_SUFFIX
            scale = handles[wm[scale_name]] if scale_name in wm else None
            total += _check_tensor(t, handles[wm[t.name]], wm[t.name], scale, wm.get(scale_name), block)
        show = progress if progress is not None else (sys.stderr.isatty() and total > _PROGRESS_MIN_BYTES)
        span = f"layer {ids[0]}" if len(ids) == 1 else f"layers {ids[0]}-{ids[-1]}"
        bar = _Progress(f"flashdsa: loading {span} from {len(handles)} shard{'s' * (len(handles) > 1)}", total,
                        bool(show))
        attention, norms, kpool = {}, {}, {}
        try:
            for i in ids:
                state = {}
                kpool[i] = {}
                for t in (t for t in wanted if t.layer == i):
                    w = _read(t, handles, wm, block, device, bar)
                    kind, _, key = t.target.partition(":")
                    if kind == "attn":
                        state[key] = w
                    elif kind == "kpool":
                        kpool[i][key] = w
                        # the indexer's own parameter: the gate in the model dtype, the place term in fp32
                        state[f"indexer.index_kpool_{key}"] = w.to(dtype) if key == "compress_gate" else w
                    else:
                        norms[i] = w
                attention[i] = _build(cfg, i, dtype, state)
        finally:
            bar.close()
    return LoadedLayers(config=cfg, attention=attention, input_layernorm=norms, kpool=kpool, source=root,
                        shards=tuple(sorted(by_shard)), hf_config=hf)


def _read(t: _Tensor, handles: dict, wm: dict[str, str], block: tuple[int, int], device: torch.device,
          bar: _Progress) -> torch.Tensor:
    """One tensor from its shard, on ``device`` in ``t.dtype`` (fp8: dequantised there with its scales)."""
    w = handles[wm[t.name]].get_tensor(t.name)
    nbytes = w.numel() * w.element_size()
    scale_name = t.name + SCALE_SUFFIX
    if scale_name in wm:
        s = handles[wm[scale_name]].get_tensor(scale_name)
        nbytes += s.numel() * s.element_size()
        # moved as fp8 (1 byte a weight), dequantised on the device
        w = dequant_fp8(w.to(device), s.to(device), block, t.dtype)
    else:
        w = w.to(device=device, dtype=t.dtype)
    # a NaN weight makes every figure computed from it NaN or, through top-k and softmax, plausible nonsense
    bad = ~torch.isfinite(w)
    if bad.any():
        raise ValueError(f"checkpoint: {t.name} in {wm[t.name]} holds {int(bad.sum())} non-finite value(s) "
                         f"(NaN or inf{', after dequantising with its ' + SCALE_SUFFIX if scale_name in wm else ''}) "
                         f"of {w.numel()}; the file is damaged or was saved from a diverged model")
    bar.add(nbytes)
    return w


def _build(cfg: DSAConfig, layer: int, dtype: torch.dtype, state: dict[str, torch.Tensor]) -> DSAAttention:
    """A DSAAttention made on the meta device, its every parameter then the loaded tensor (no random init)."""
    with torch.device("meta"):
        attn = DSAAttention(cfg, layer, dtype)
    missing = [n for n, _ in attn.named_parameters() if "index_kpool_" in n and n not in state]
    if missing:
        raise ValueError(f"checkpoint: index_kpool = {cfg.index_kpool} but layer {layer} has no "
                         f"self_attn.{missing[0]} (the pooled indexer keys need it)")
    attn.load_state_dict(state, strict=True, assign=True)
    attn.requires_grad_(False)
    assert not any(p.is_meta for p in attn.parameters()), "every parameter comes from the checkpoint"
    return attn.eval()

"""Patching an HF DSA model in place: :func:`apply`, :func:`unapply`, :func:`get_patch` and :class:`Patch`.

Per layer the adapter is a :class:`flashdsa.layers.DSAAttention` whose submodules ARE the HF layer's
(``q_a_proj`` … ``o_proj``, ``indexer.wq_b`` …): no weight is copied, ``model.to(...)`` moves both. It runs
the layer's step (indexer -> exact top-k -> sparse MLA, or the dense fallback while every context fits in
``index_topk``) over flashdsa's paged caches, on batches the :class:`flashdsa.engine.Runner` prepares in
the decoder's forward hooks. The MLP / MoE, norms, embeddings and LM head stay HF's.

Numerics:
    * ``indexer="exact"``: the indexer of :mod:`flashdsa.layers.indexer` in exact precision — no Hadamard,
      no fp8, fp32 scores ``sum_h w relu(q . k / sqrt(D))`` — the numbers HF's indexer computes, so the
      same tokens are selected. ``indexer="fp8"``: the deployment numerics of docs/DSA.md §3 (DeepGEMM's).
    * RoPE comes from HF's own ``position_embeddings`` (cos / sin of HF's ``position_ids``, YaRN attention
      factor included). MLA RoPE uses interleaved pairs (HF's ``apply_rotary_pos_emb_interleave`` writes the
      same pairs de-interleaved; only q . k matters and q and k share one layout). Indexer RoPE: NeoX pairs
      for V3.2, interleaved for GLM (``DSAConfig.indexer_rope_interleave``).
    * GLM's ``indexer_types``: a "shared" layer has no indexer (in HF as here) and reuses the previous
      layer's selection.
    * GLM-5.3-Flash: NoPE (no ``position_embeddings``; the rows' rope part zero), kpool (exact: HF's pooling
      and selection op for op, ``layers.indexer.pool_as_hf``; fp8: ``ops.kpool_compress``), a hybrid stack
      (only the "indexed_attention" layers are patched).
    * The attention runs at the model's precision (``kv_format="auto"``): for an fp32 model the absorbed
      query, the MLA cache rows (the "fp32" format, 2304 B a token) and the attention kernels are fp32
      (IEEE products), so ``indexer="exact"`` reproduces HF's fp32 logits to fp32 rounding (~1e-6 of their
      maximum on the tests' models) and its greedy tokens; otherwise bf16 rows and query, as deployed,
      whose distance from HF's fp32 answer is that of HF's own bf16 run. ``kv_format="bf16"`` on an fp32
      model rounds the attention to bf16 (2-3e-2 of the logits' maximum on the same models).
"""

from __future__ import annotations

import functools
import inspect
import math
import weakref
from dataclasses import dataclass, field

import torch
import transformers
from transformers.cache_utils import Cache

from flashdsa.cache.layouts import mla_rows_fit
from flashdsa.config import DSAConfig, is_dsa
from flashdsa.engine.runner import Runner
from flashdsa.hf.cache import FlashDSACache, _Forward, _NoMasks, get_patch
from flashdsa.hf.graphs import _GraphDecode
from flashdsa.hf.v4 import apply_v4
from flashdsa.layers.attention import DSAAttention
from flashdsa.layers.indexer import PRECISIONS
from flashdsa.v4.config import is_v4

_MIN_TRANSFORMERS = (5, 23)
_MLA_PARTS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
              "o_proj")
_INDEXER_PARTS = ("wq_b", "wk", "k_norm", "weights_proj")
_KPOOL_PARTS = ("index_kpool_compress_gate", "index_kpool_compress_ape")
KV_FORMATS = ("auto", "bf16", "fp8", "fp32")


def _version(v: str) -> tuple[int, int]:
    parts = v.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


# ---- the patch ---------------------------------------------------------------------------------------

@dataclass(eq=False, repr=False)
class Patch(_GraphDecode):
    """What :func:`apply` installed on a model (``get_patch(model)``).

    ``calls[i]``: forwards of DSA layer i through flashdsa (each layer once per model forward, a graph
    replay included); ``config`` is the DSA layers alone (``DSAConfig.dsa_stack``), ``hf_layers[i]`` the
    decoder layer DSA layer i is (all of them but a hybrid stack's linear-attention layers, which stay HF's
    and keep their state in HF's cache layers inside the :class:`FlashDSACache`). ``runner``: the :class:`Runner` owning the pool (made on the first forward, on
    the model's device); with ``record=True`` its ``selections`` hold each layer's last selection.
    ``cuda_graphs``: decode steps replay CUDA graphs (may be switched off at any time);
    ``graphs``: the captured ones by ``(batch, block-table pages)``; ``graph_replays``: steps they ran (the
    methods that use them: the base, :class:`flashdsa.hf.graphs._GraphDecode`).
    """

    model: torch.nn.Module
    config: DSAConfig
    indexer: str
    kv_format: str
    max_tokens: int
    backend: str | None
    record: bool
    attentions: list[DSAAttention]
    hf_layers: list[int] = field(default_factory=list)
    num_hf_layers: int = 0
    cuda_graphs: bool = True
    cache_kw: str = "cache"               # the decoder's name for its cache argument
    calls: list[int] = field(default_factory=list)
    runner: Runner | None = None
    closed: bool = False
    graphs: dict = field(default_factory=dict)
    graph_replays: int = 0
    graph_failure: str | None = None      # why graphs are off for this patch (a capture that failed)
    _hf_caches: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    _hooks: list = field(default_factory=list)
    _patched: list = field(default_factory=list)
    _fwd: _Forward | None = None

    def __repr__(self) -> str:
        return (f"Patch({type(self.model).__name__}, indexer={self.indexer!r}, kv_format={self.kv_format!r}, "
                f"max_tokens={self.max_tokens}, cuda_graphs={self.cuda_graphs}, calls={self.calls}"
                f"{', closed' if self.closed else ''})")

    # ---- hooks on the decoder (model.model) ----------------------------------------------------------
    def _begin(self, module, args, kwargs):
        if self.closed:
            raise RuntimeError("flashdsa.hf: this patch was removed (unapply / a new apply)")
        if len(args) > 1:
            raise ValueError("flashdsa.hf: pass the decoder's arguments by keyword (input_ids=..., attention_mask=...)")
        # the cache by either name (transformers >= 5.25 calls it `cache`, earlier `past_key_values`), handed on
        # under the decoder's own name: a decoder that does not know the name makes a cache of its own
        given = kwargs.pop("cache", None)
        old = kwargs.pop("past_key_values", None)
        given = old if given is None else given
        ids = kwargs.get("input_ids", args[0] if args else None)
        ref = ids if ids is not None else kwargs.get("inputs_embeds")
        if ref is None:
            raise ValueError("input_ids / inputs_embeds: one of them is required")
        if torch.is_grad_enabled() and module.training:
            raise ValueError("flashdsa.hf is inference-only: call model.eval() or run under torch.no_grad()")
        B, S = ref.shape[:2]
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.model.config, "use_cache", True)
        cache, temporary = self._cache_for(given, use_cache)
        kwargs[self.cache_kw] = cache
        real = self._real_tokens(kwargs.get("attention_mask"), cache, B, S)
        kwargs["attention_mask"] = _NoMasks()
        if self.hybrid and real is not None and S > 1:
            # HF's linear-attention layers zero padded columns (create_recurrent_attention_mask); DSA's see none
            kwargs["attention_mask"]["linear_attention"] = real.to(ref.device)
        runner = self._runner_for(ref.device)
        if self.record:
            runner.selections = {}
        tok_idx = None if real is None else real.reshape(-1).nonzero().squeeze(1).to(ref.device)
        pages = self._graph_pages(kwargs, cache, real, B, S, ref.device)
        meta = cache._advance(runner, real, B, S, pages)  # the last step that can fail here: _end undoes it
        self._fwd = _Forward(meta, cache, tok_idx, temporary, pages)
        return args, kwargs

    def _end(self, module, args, kwargs, output):
        fwd, self._fwd = self._fwd, None
        if fwd is None:
            return
        # An always_call hook: after a forward that raised, torch calls it with output None.
        if output is None:
            fwd.cache._abort(self.runner)
        else:
            fwd.cache._commit()
        if fwd.temporary:
            fwd.cache.reset()

    def _cache_for(self, cache, use_cache: bool) -> tuple[FlashDSACache, bool]:
        if cache is None:
            return FlashDSACache(self), not use_cache
        if isinstance(cache, FlashDSACache):
            if cache.patch is not self:
                raise ValueError("cache: this FlashDSACache belongs to an earlier flashdsa.hf.apply of the model; "
                                 "start a new one")
            return cache, False
        if isinstance(cache, Cache):
            mine = self._hf_caches.get(cache)
            if mine is not None:
                return mine, False
            if cache.get_seq_length() == 0:
                mine = self._hf_caches[cache] = FlashDSACache(self)
                return mine, False
        raise ValueError(f"cache: a {type(cache).__name__} already holding {cache.get_seq_length()} tokens of KV "
                         "computed without flashdsa; pass no cache, an empty one, or a flashdsa.hf.FlashDSACache")

    @staticmethod
    def _real_tokens(mask, cache: FlashDSACache, B: int, S: int) -> torch.Tensor | None:
        """``[B, S] bool`` (CPU) of the new columns that hold real tokens, or None when all do."""
        if mask is None:
            return None
        if not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            raise ValueError("attention_mask: flashdsa.hf supports a 2-D [batch, past + new] padding mask (or "
                             f"none), got {type(mask).__name__} {list(getattr(mask, 'shape', []))} (a static / "
                             "compiled cache_implementation in generate() makes 4-D masks: use the default)")
        if mask.shape != (B, cache.seen + S):
            raise ValueError(f"attention_mask: expected shape [{B}, {cache.seen + S}] (cached columns + new ones), "
                             f"got {list(mask.shape)}")
        real = mask[:, -S:].bool().cpu() if S else torch.zeros(B, 0, dtype=torch.bool)
        return None if bool(real.all()) else real

    def _runner_for(self, device: torch.device) -> Runner:
        r = self.runner
        if r is not None and r.pool.device == device and r.pool.kv_format == self.cache_format():
            return r
        if r is not None and r.alloc.req_ids:
            raise ValueError(f"flashdsa.hf: the model moved to {device} / {self.cache_format()} caches while "
                             f"{r.pool.kv_format} caches on {r.pool.device} are live; drop or reset them first")
        num_pages = math.ceil(self.max_tokens / self.config.page_size)
        fmt = self.cache_format()
        self.graphs.clear()  # they read the old pool's caches
        self.runner = Runner.for_layers(self.config, device, num_pages, fmt, backend=self.backend,
                                        record=self.record)
        for attn in self.attentions:
            attn.mla_dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        return self.runner

    @property
    def hybrid(self) -> bool:
        """Linear-attention layers between the DSA ones (GLM-5.3-Flash)."""
        return len(self.hf_layers) != self.num_hf_layers

    def cache_format(self) -> str:
        """The MLA cache format in use: ``kv_format`` as given, or for "auto" "fp32" while the model's
        attention weights are fp32 and "bf16" otherwise."""
        if self.kv_format != "auto":
            return self.kv_format
        return "fp32" if self.attentions[0].kv_a_proj_with_mqa.weight.dtype == torch.float32 else "bf16"

    # ---- the attention layers -----------------------------------------------------------------------
    def _attend(self, lid: int, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
        fwd = self._fwd
        if fwd is None:
            raise RuntimeError("flashdsa.hf: a patched attention layer ran outside its model's forward")
        B, S, D = hidden_states.shape
        x = hidden_states.reshape(B * S, D)
        if fwd.tok_idx is not None:
            x = x.index_select(0, fwd.tok_idx)
        if fwd.cos is None:
            if self.config.qk_rope_head_dim == 0:  # NoPE: HF hands no position_embeddings
                fwd.cos = fwd.sin = x.new_empty(x.shape[0], 0, dtype=torch.float32)
            else:
                fwd.cos, fwd.sin = (_rope_half(t, B, S, fwd.tok_idx) for t in position_embeddings)
        with torch.no_grad():
            out, fwd.prev = self.attentions[lid](x, fwd.cos, fwd.sin, fwd.meta, self.runner.pool, fwd.prev)
        if self.record:
            self.runner.selections[lid] = fwd.prev
        self.calls[lid] += 1
        if fwd.tok_idx is not None:
            full = out.new_zeros(B * S, D)
            full[fwd.tok_idx] = out
            out = full
        return out.view(B, S, D)


def _rope_half(t: torch.Tensor, B: int, S: int, tok_idx: torch.Tensor | None) -> torch.Tensor:
    """HF's cos or sin ``[B or 1, S, R]`` (``cat(freqs, freqs)``) -> flashdsa's ``[T, R / 2] f32``."""
    t = t.expand(B, S, t.shape[-1]).reshape(B * S, t.shape[-1])[:, : t.shape[-1] // 2].float()
    return t if tok_idx is None else t.index_select(0, tok_idx)


def _attention_forward(patch: Patch, lid: int, returns_topk: bool):
    def forward(hidden_states, position_embeddings=None, attention_mask=None, cache=None, position_ids=None,
                **kwargs):
        out = patch._attend(lid, hidden_states, position_embeddings)
        # GLM's layers hand their top-k on (prev_topk_indices); flashdsa threads the selection itself
        return (out, None, None) if returns_topk else (out, None)
    return forward


# ---- installing it -----------------------------------------------------------------------------------

def _decoder(model):
    """The module holding the decoder layers: ``model.model`` / ``model`` or, in a multimodal model
    (GLM-5.3-Flash), its ``language_model``."""
    for base in (getattr(model, "model", None), model):
        for m in (base, getattr(base, "language_model", None)):
            if isinstance(getattr(m, "layers", None), torch.nn.ModuleList):
                return m
    raise ValueError(f"model: expected an HF decoder-only model with .model.layers (or .layers, or "
                     f".model.language_model.layers), got {type(model).__name__}")


def _adopt(hf_attn, cfg: DSAConfig, lid: int, precision: str) -> DSAAttention:
    """A DSAAttention whose submodules are the HF layer's own (built on meta, then every part replaced).
    ``cfg`` is the DSA stack, ``lid`` the layer's place in it."""
    missing = [p for p in _MLA_PARTS + ("scaling",) if not hasattr(hf_attn, p)]
    if missing:
        raise ValueError(f"model: layer {lid}'s attention ({type(hf_attn).__name__}) is not DSA's MLA: it lacks "
                         f"{missing}")
    hf_indexer = getattr(hf_attn, "indexer", None)
    if (hf_indexer is not None) != (lid in cfg.topk_layers):
        raise ValueError(f"model: layer {lid} {'has' if hf_indexer is not None else 'lacks'} an indexer but the "
                         f"config says it {'computes' if lid in cfg.topk_layers else 'reuses'} top-k")
    with torch.device("meta"):
        attn = DSAAttention(cfg, lid)
    for name in _MLA_PARTS:
        setattr(attn, name, getattr(hf_attn, name))
    attn.softmax_scale = float(hf_attn.scaling)
    attn.fused_rows = precision != "exact"  # exact: the torch ops, HF's bits (layers.mla_rows)
    if attn.indexer is not None:
        missing = [p for p in _INDEXER_PARTS if not hasattr(hf_indexer, p)]
        if missing:
            raise ValueError(f"model: layer {lid}'s indexer lacks {missing}")
        parts = _INDEXER_PARTS + (_KPOOL_PARTS if cfg.index_kpool > 1 else ())
        missing = [p for p in parts if not hasattr(hf_indexer, p)]
        if missing:
            raise ValueError(f"model: layer {lid}'s indexer lacks {missing} (index_kpool = {cfg.index_kpool})")
        for name in parts:
            setattr(attn.indexer, name, getattr(hf_indexer, name))
        attn.indexer.precision = precision
    assert not any(p.is_meta for p in attn.parameters()), "every part of the adapter is the HF layer's"
    return attn


def apply(model, indexer: str = "fp8", *, kv_format: str = "auto", max_tokens: int = 32768,
          backend: str | None = None, record: bool = False, cuda_graphs: bool = True) -> Patch:
    """Patch an HF DSA model (``DeepseekV32ForCausalLM``, ``GlmMoeDsaForCausalLM``,
    ``Glm5NextForConditionalGeneration``) in place.

    Args:
        model:      the HF model (the ``*ForCausalLM`` or its decoder ``*Model``).
        indexer:    "fp8" (deployment numerics, docs/DSA.md §3) or "exact" (fp32 scores, HF's numbers).
        kv_format:  MLA cache format: "auto" (default: the model's own precision — "fp32" for an fp32
                    model, "bf16" otherwise; decided on each new pool, i.e. after ``model.to(dtype)`` too),
                    "bf16", "fp8" (656-B FlashMLA rows) or "fp32" (2304-B rows; the absorbed query and
                    the attention kernels in fp32 too, IEEE products: exact to fp32 rounding).
        max_tokens: capacity of the paged pool in tokens, over all live sequences (each row rounds up to
                    64-token pages); made on the first forward, on the model's device. (DeepSeek-V4: unused,
                    its buffers grow with the batch.)
        backend:    force flashdsa's op backend ("torch" / "triton"); default: Triton on CUDA.
        record:     keep each layer's last selection in ``get_patch(model).runner.selections`` (decode
                    then runs eagerly).
        cuda_graphs: replay decode steps of batches up to 16 rows from CUDA graphs (on CUDA, Triton
                    backends; see :mod:`flashdsa.hf.graphs`). False: every step eagerly.

    Returns the :class:`Patch`. Applying again replaces the previous patch (same settings: a no-op in
    effect; caches of the old patch become invalid). ValueError for a model that is not DSA.
    """
    if _version(transformers.__version__) < _MIN_TRANSFORMERS:
        raise ImportError(f"flashdsa.hf needs transformers >= {'.'.join(map(str, _MIN_TRANSFORMERS))}, "
                          f"found {transformers.__version__}")
    if indexer not in PRECISIONS:
        raise ValueError(f"indexer: expected one of {PRECISIONS}, got {indexer!r}")
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format: expected one of {KV_FORMATS}, got {kv_format!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected an int >= 1, got {max_tokens!r}")
    if not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs: expected a bool, got {cuda_graphs!r}")
    hf_config = getattr(model, "config", None)
    d = hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}
    if is_v4(d):  # DeepSeek-V4 (flashdsa/hf/v4.py: its state, its graphs, what is missing)
        if kv_format != "auto":
            raise ValueError(f"kv_format: DeepSeek-V4's rows follow `indexer` (exact: the model dtype, fp8: fp8 "
                             f"rows); expected 'auto', got {kv_format!r}")
        if record:
            raise NotImplementedError("record: keeping the selections is not built for DeepSeek-V4 yet")
        if get_patch(model) is not None:
            unapply(model)
        return apply_v4(model, indexer, backend, cuda_graphs)
    if not is_dsa(d):
        raise ValueError(f"model: {type(model).__name__} is not a DSA model (flashdsa.hf patches DeepSeek-V3.2 / "
                         f"GLM-5 / GLM-5.3-Flash models: a DSA architecture with index_topk; got model_type "
                         f"{d.get('model_type')!r}, index_topk {d.get('index_topk')!r})")
    full = DSAConfig.from_hf(d)
    why = mla_rows_fit(full.kv_lora_rank, full.qk_rope_head_dim, full.index_head_dim)
    if why is not None:
        raise ValueError(f"model: flashdsa's caches need {why}")
    base = _decoder(model)
    if len(base.layers) != full.num_hidden_layers:
        raise ValueError(f"model: {len(base.layers)} layers, the config says {full.num_hidden_layers}")
    if get_patch(model) is not None:
        unapply(model)
    cfg, hf_layers = full.dsa_stack(), full.dsa_layers
    attentions = [_adopt(base.layers[h].self_attn, cfg, i, indexer) for i, h in enumerate(hf_layers)]
    patch = Patch(model=model, config=cfg, indexer=indexer, kv_format=kv_format, max_tokens=max_tokens,
                  backend=backend, record=record, attentions=attentions, hf_layers=hf_layers,
                  num_hf_layers=full.num_hidden_layers, cuda_graphs=cuda_graphs, calls=[0] * len(hf_layers))
    for i, h in enumerate(hf_layers):
        hf_attn = base.layers[h].self_attn
        returns_topk = "prev_topk_indices" in inspect.signature(type(hf_attn).forward).parameters
        hf_attn.forward = _attention_forward(patch, i, returns_topk)
        patch._patched.append(hf_attn)
    if "cache" not in inspect.signature(type(base).forward).parameters:
        patch.cache_kw = "past_key_values"  # transformers 5.23-5.24
    base.forward = functools.partial(patch._decoder_forward, type(base).forward.__get__(base))
    patch._patched.append(base)
    patch._hooks = [base.register_forward_pre_hook(patch._begin, with_kwargs=True),
                    base.register_forward_hook(patch._end, with_kwargs=True, always_call=True)]
    model.__dict__["_flashdsa_patch"] = patch  # a plain attribute: not a submodule, not in the state dict
    return patch


def unapply(model) -> None:
    """Remove :func:`apply`'s patch: HF's attention again; the pool is dropped, its caches become invalid."""
    patch = get_patch(model)
    if patch is None:
        raise ValueError("model: not patched by flashdsa.hf.apply")
    for module in patch._patched:  # the attention layers and the decoder
        module.__dict__.pop("forward", None)
    for h in patch._hooks:
        h.remove()
    patch.graphs.clear()
    patch.closed, patch.runner, patch._fwd = True, None, None
    del model.__dict__["_flashdsa_patch"]

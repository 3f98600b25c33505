"""``flashdsa report``: how much of dense attention DSA's top-k keeps, layer by layer, on a checkpoint's weights.

For a range of layers (loaded by :mod:`flashdsa.checkpoint`) and a few context lengths N, one prefill of
N tokens runs through the layers' own DSA step on the engine path (``Runner.for_layers`` prepares the
batch, ``DSAAttention.forward`` does the rest) three times: the dense fallback, sparse with the exact
indexer, sparse with the fp8 indexer. Measured on the last Q query rows (each sees more than
``index_topk`` keys, so the selection matters), means over rows and heads:

    mass_exact, mass_fp8   share of the dense attention probability on the keys the indexer selected
    mass_oracle            the same for the best k keys one selection shared by all heads could take
                           (top-k of the head-mean probabilities): the ceiling of any shared top-k; k is
                           the widest selection, index_topk + c - 1 with kpool (its tail group)
    fp8_recall             |fp8 selection ∩ exact selection| / |exact selection|
    out_diff_<p>           ||out_sparse - out_dense|| / ||out_dense||, the layer's output after o_proj
    overlap_prev_<p>       |sel(l) ∩ sel(l-1)| / |sel(l)|: the share of this layer's pick the previous
                           layer already made (1 on a skip-top-k layer, which reuses it)
    reuse_mass_<p>         this layer's mass on the PREVIOUS layer's selection: what skip-top-k reuse at
                           this layer would keep (compare with mass_<p>); None for the first layer

The probabilities are ``softmax(q . kv * softmax_scale)`` over each row's visible keys, in float64, from
the bf16 absorbed queries ``[Q, h, 576]`` and cache rows ``[N, 576]`` the layer itself computed: exactly
what the kernels attend over. The MLA cache is bf16, so ``out_diff`` is the selection's alone.

Hidden states (the residual stream entering a layer, before its input RMSNorm):
    * synthetic: iid N(0, 1) tokens (seeded). Real weights on random tokens: the numbers show the
      mechanics, not the model; real ones need ``--hidden``.
    * ``--hidden FILE`` (``.pt`` via ``torch.save``, or ``.safetensors`` with one tensor or one named
      ``hidden_states``): ``[T, hidden]`` enters the first layer; or ``[L, T, hidden]`` (or ``[L, 1, T,
      hidden]``) with L = num_hidden_layers or num_hidden_layers + 1 — HF's ``output_hidden_states``
      stacked, entry l being the input of layer l — gives every layer its own real input.
    With one input, layer l + 1 gets ``x + dense attention output`` of layer l: no MLP / MoE (not loaded),
    an attention-only residual stream; the report says which.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from flashdsa.cache.layouts import mla_rows_fit
from flashdsa.checkpoint import LoadedLayers, load_layers, parse_layers, read_hf_config
from flashdsa.config import DSAConfig
from flashdsa.engine.runner import Runner
from flashdsa.layers import DSAAttention, RMSNorm, RotaryEmbedding

DEFAULT_QUERIES = 64
PRECISIONS = ("exact", "fp8")
_PROB_BYTES = 256 << 20     # bound on one chunk of [rows, h, N] float64 probabilities
_REQ = "report"
METRICS = ("mass_exact", "mass_fp8", "mass_oracle", "fp8_recall", "out_diff_exact", "out_diff_fp8",
           "overlap_prev_exact", "overlap_prev_fp8", "reuse_mass_exact", "reuse_mass_fp8")


def default_contexts(cfg: DSAConfig) -> list[int]:
    """2, 4 and 8 times ``index_topk`` (4K, 8K, 16K for V3.2 and GLM-5)."""
    return [2 * cfg.index_topk, 4 * cfg.index_topk, 8 * cfg.index_topk]


# ---- what one layer produced at one context ------------------------------------------------------------

@dataclass
class LayerRun:
    """One layer's tensors at one context N, for its last Q query rows (h heads, k = index_topk).

    ``positions [Q] int64`` (row i sees keys ``0 .. positions[i]``), ``q [Q, h, 576] bf16`` absorbed
    queries, ``kv [N, 576] bf16`` cache rows, ``out_dense [Q, hidden]`` and ``out[p] [Q, hidden]`` the
    layer's outputs (dense fallback; sparse with indexer precision p), ``sel[p] [Q, k] int32`` the selected
    key positions (-1 padded), ``softmax_scale`` the layer's.
    """

    layer: int
    context: int
    skip: bool
    positions: torch.Tensor
    q: torch.Tensor
    kv: torch.Tensor
    out_dense: torch.Tensor
    out: dict[str, torch.Tensor]
    sel: dict[str, torch.Tensor]
    softmax_scale: float


@contextlib.contextmanager
def _pool_layer(attn: DSAAttention, index: int) -> Iterator[None]:
    """Address the runner's pool as layer ``index``: the pool holds only the report's window of layers."""
    real = attn.layer_id
    attn.layer_id = index
    try:
        yield
    finally:
        attn.layer_id = real


def window_config(cfg: DSAConfig, layers: Sequence[int]) -> DSAConfig:
    """``cfg`` cut to ``layers`` (renumbered 0..n-1) with each one's skip-top-k status kept, for the pool (a
    hybrid stack's window holds its DSA layers only: no layer_types)."""
    skip = set(cfg.skip_topk_layers)
    kinds = tuple("shared" if l in skip else "full" for l in layers)
    return cfg.replace(num_hidden_layers=len(layers), indexer_types=kinds, index_topk_pattern=None,
                       index_topk_freq=None, index_skip_topk_offset=None, layer_types=None)


def check_window(cfg: DSAConfig, layers: Sequence[int]) -> None:
    """A contiguous range whose first layer computes its own top-k (the report has no earlier selection), of a
    model whose sizes the engine's caches take."""
    if list(layers) != list(range(layers[0], layers[0] + len(layers))):
        raise ValueError(f"layers: expected a contiguous range A-B (each layer is compared with the one before), "
                         f"got {list(layers)}")
    if layers[0] in cfg.skip_topk_layers:
        start = max(l for l in cfg.topk_layers if l < layers[0])
        raise ValueError(f"layers: layer {layers[0]} reuses the top-k of the layer before it (skip-top-k); start "
                         f"the range at layer {start}, the last one that computes its own")
    why = mla_rows_fit(cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim)
    if why is not None:
        raise ValueError(f"checkpoint: the engine's caches need {why}")


def run_context(loaded: LoadedLayers, hidden: torch.Tensor | dict[int, torch.Tensor], context: int, queries: int, *,
                backend: str | None = None) -> list[LayerRun]:
    """Run the loaded layers over the first ``context`` tokens on the engine path; the last ``queries`` rows' tensors.

    Args:
        hidden:    ``[T, hidden]``, the first layer's input, or ``{layer: [T, hidden]}`` every layer's own;
                   float, on the layers' device, T >= context.
        queries:   rows measured, ``1 <= queries <= context - index_topk``.

    Three prefills of one request: dense fallback (which also builds the attention-only residual stream
    from a single input), then sparse with the exact and with the fp8 indexer on the same inputs.
    """
    cfg, layers = loaded.config, loaded.layers
    attns = [loaded.attention[l] for l in layers]
    device = attns[0].q_a_proj.weight.device
    dtype = attns[0].q_a_proj.weight.dtype
    window = window_config(cfg, layers)
    N, Q = context, queries
    pages = -(-N // cfg.page_size)
    positions = torch.arange(N, device=device)
    cos, sin = RotaryEmbedding(cfg).to(device)(positions)
    norms = {}
    for l in layers:
        norms[l] = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).to(device)
        norms[l].weight.data.copy_(loaded.input_layernorm[l])

    # dense: the reference outputs, the cache rows, the queries, and each layer's normed input
    dense = Runner.for_layers(window, device, pages, "bf16", backend=backend, dense_threshold=N, max_dense_tokens=N)
    meta, _ = dense.prepare({_REQ: N})
    assert meta.use_dense
    per_layer = isinstance(hidden, dict)
    x = None if per_layer else hidden[:N].to(dtype)
    inputs, runs = {}, []
    for j, (l, attn) in enumerate(zip(layers, attns)):
        xin = hidden[l][:N].to(dtype) if per_layer else x
        xn = norms[l](xin)
        with _pool_layer(attn, j):
            out, _ = attn(xn, cos, sin, meta, dense.pool, None)
        inputs[l] = xn
        q = attn.prepare(xn[-Q:], cos[-Q:], sin[-Q:])[0]
        runs.append(LayerRun(layer=l, context=N, skip=attn.indexer is None, positions=positions[-Q:].clone(), q=q,
                             kv=dense.pool.read(j, meta.kv_slots), out_dense=out[-Q:].clone(), out={}, sel={},
                             softmax_scale=attn.softmax_scale))
        if not per_layer:
            x = xin + out
    del dense

    for p in PRECISIONS:
        sparse = Runner.for_layers(window, device, pages, "bf16", backend=backend)
        meta, _ = sparse.prepare({_REQ: N}, force_sparse=True)
        sel = None
        for j, (attn, run) in enumerate(zip(attns, runs)):
            keep = attn.indexer.precision if attn.indexer is not None else None
            try:
                if attn.indexer is not None:
                    attn.indexer.precision = p
                with _pool_layer(attn, j):
                    out, sel = attn(inputs[run.layer], cos, sin, meta, sparse.pool, sel)
            finally:
                if keep is not None:
                    attn.indexer.precision = keep
            run.out[p], run.sel[p] = out[-Q:].clone(), sel[-Q:].clone()
        del sparse
    return runs


# ---- the measures ------------------------------------------------------------------------------------

def attention_probs(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> Iterator[tuple[slice, torch.Tensor]]:
    """Dense causal attention probabilities in float64, in chunks of rows.

    ``q [Q, h, D]``, ``kv [N, D]``, ``positions [Q]`` (row i sees keys ``0 .. positions[i]``) -> yields
    ``(rows, p [len(rows), h, N] float64)`` with ``p = softmax(q . kv * scale)`` over the visible keys, 0 past them.
    """
    Q, h, _ = q.shape
    N = kv.shape[0]
    kv64 = kv.double()
    cols = torch.arange(N, device=kv.device)
    step = max(1, _PROB_BYTES // (8 * h * max(N, 1)))
    for r0 in range(0, Q, step):
        rows = slice(r0, min(Q, r0 + step))
        logits = torch.einsum("rhd,nd->rhn", q[rows].double(), kv64) * scale
        hidden = cols[None, :] > positions[rows, None]
        logits.masked_fill_(hidden[:, None, :], float("-inf"))
        yield rows, torch.softmax(logits, dim=-1)


def _sel_mass(p: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """``p [r, h, N]``, ``sel [r, k]`` (-1 = none) -> ``[r]`` float64: selected probability, mean over heads."""
    r, h, _ = p.shape
    idx = sel.long().clamp_min(0)[:, None, :].expand(r, h, -1)
    got = p.gather(2, idx) * (sel >= 0)[:, None, :]
    return got.sum(-1).mean(-1)


def _members(sel: torch.Tensor, n: int) -> torch.Tensor:
    """``sel [r, k]`` positions (-1 = none) -> ``[r, n]`` bool membership."""
    m = torch.zeros(sel.shape[0], n + 1, dtype=torch.bool, device=sel.device)
    m.scatter_(1, torch.where(sel >= 0, sel.long(), n), True)
    return m[:, :n]


def overlap(sel: torch.Tensor, ref: torch.Tensor, n: int) -> float:
    """Mean over rows of ``|sel ∩ ref| / |ref|`` for ``[r, k]`` position lists over ``n`` keys (-1 = none)."""
    a, b = _members(sel, n), _members(ref, n)
    return float(((a & b).sum(1).double() / b.sum(1).clamp_min(1).double()).mean())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def measure(run: LayerRun, prev: LayerRun | None, topk: int) -> dict:
    """The report's numbers for one layer at one context (module docstring); ``prev`` = the layer before, or None."""
    mass = {p: [] for p in PRECISIONS}
    reuse = {p: [] for p in PRECISIONS}
    oracle = []
    for rows, p in attention_probs(run.q, run.kv, run.positions, run.softmax_scale):
        for prec in PRECISIONS:
            mass[prec].append(_sel_mass(p, run.sel[prec][rows]))
            if prev is not None:
                reuse[prec].append(_sel_mass(p, prev.sel[prec][rows]))
        oracle.append(p.mean(1).topk(min(topk, p.shape[-1]), dim=-1).values.sum(-1))
    N = run.kv.shape[0]
    row = {"layer": run.layer, "context": run.context, "skip_topk": run.skip, "queries": run.q.shape[0]}
    for prec in PRECISIONS:
        row[f"mass_{prec}"] = float(torch.cat(mass[prec]).mean())
    row["mass_oracle"] = float(torch.cat(oracle).mean())
    row["fp8_recall"] = overlap(run.sel["fp8"], run.sel["exact"], N)
    for prec in PRECISIONS:
        row[f"out_diff_{prec}"] = _rel(run.out[prec], run.out_dense)
    for prec in PRECISIONS:
        row[f"overlap_prev_{prec}"] = None if prev is None else overlap(prev.sel[prec], run.sel[prec], N)
        row[f"reuse_mass_{prec}"] = None if prev is None else float(torch.cat(reuse[prec]).mean())
    return row


# ---- hidden states -----------------------------------------------------------------------------------

def read_hidden(path: str | os.PathLike, cfg: DSAConfig) -> tuple[torch.Tensor, bool]:
    """A saved hidden-state tensor -> (``[T, hidden]`` or ``[L, T, hidden]`` float, per_layer). Shapes: module
    docstring. A ``.pt`` file is memory-mapped: only the rows the report uses are read (and checked finite)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"hidden: {path} does not exist")
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(path)
        except SafetensorError as e:
            raise ValueError(f"hidden: {path} is not a readable safetensors file ({e})") from None
        if "hidden_states" in tensors:
            t = tensors["hidden_states"]
        elif len(tensors) == 1:
            t = next(iter(tensors.values()))
        else:
            raise ValueError(f"hidden: {path} holds {sorted(tensors)[:4]}...; expected one tensor or one named "
                             f"'hidden_states'")
    else:
        try:
            t = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # pickle / zip errors of every kind: not a tensor file
            raise ValueError(f"hidden: {path} is not a tensor saved with torch.save ({type(e).__name__}: {e})") from None
        if isinstance(t, (tuple, list)) and t and all(isinstance(x, torch.Tensor) for x in t):
            t = torch.stack(list(t))     # HF's output_hidden_states tuple, saved as is
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise ValueError(f"hidden: expected a float tensor in {path}, got {type(t).__name__}"
                         f"{' ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    if t.dim() == 4 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    per_layer = t.dim() == 3
    if t.shape[-1] != H or not (t.dim() == 2 or (per_layer and t.shape[0] in (L, L + 1))):
        raise ValueError(f"hidden: expected [T, {H}] (the first layer's input) or [{L} or {L + 1}, T, {H}] (every "
                         f"layer's input, as HF's output_hidden_states), got {list(t.shape)} in {path}")
    return t, per_layer


def synthetic_hidden(tokens: int, cfg: DSAConfig, seed: int) -> torch.Tensor:
    """``[tokens, hidden] float32`` iid N(0, 1), from ``torch.Generator().manual_seed(seed)``."""
    return torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))


# ---- the command -------------------------------------------------------------------------------------

def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return value


def run_report(checkpoint: str | os.PathLike, layers: str | Sequence[int], *, contexts: Sequence[int] | None = None,
               device: str | torch.device = "cpu", hidden: str | os.PathLike | None = None,
               queries: int = DEFAULT_QUERIES, seed: int = 0, backend: str | None = None,
               progress: bool | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Load ``layers`` of ``checkpoint`` and measure them at each context (module docstring).

    Args:
        contexts: context lengths N, each > index_topk (default: those of :func:`default_contexts` that
                  ``hidden`` holds, or all its tokens if it holds none of them).
        device:   "cpu", "cuda" or "cuda:N".
        hidden:   a saved hidden-state file, or None for synthetic tokens (``seed``).
        queries:  query rows measured per context (the last ones), clipped to N - index_topk (each row says
                  how many it measured).
        progress: the loader's progress line (None = on a terminal); ``log``: one line per context.

    Returns a JSON-ready dict: ``checkpoint``, ``architectures``, ``layers``, ``index_topk``, ``hidden``
    (what the inputs were), ``contexts``, ``rows`` (one per layer and context: :data:`METRICS` + ``layer``,
    ``context``, ``skip_topk``, ``queries``), ``seconds``. Every argument is checked before any weight is read.
    """
    from flashdsa.demo import parse_device

    t0 = time.perf_counter()
    dev = parse_device(device) if isinstance(device, str) else torch.device(device)
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"backend: expected 'torch', 'triton' or None, got {backend!r}")
    if backend == "triton" and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend: 'triton' needs --device cuda (or TRITON_INTERPRET=1 to interpret the kernels on "
                         f"the CPU, very slowly), got {dev}")
    _check_int("queries", queries, 1)
    _check_int("seed", seed, 0)
    _, cfg = read_hf_config(checkpoint)
    ids = parse_layers(layers, cfg.num_hidden_layers)
    check_window(cfg, ids)
    ctxs = default_contexts(cfg) if contexts is None else list(contexts)
    if not ctxs:
        raise ValueError("context: expected at least one context length")
    for n in ctxs:
        _check_int("context", n, 1)
        if n <= cfg.index_topk:
            raise ValueError(f"context: expected lengths > index_topk ({cfg.index_topk}): at or below it top-k keeps "
                             f"every token, got {n}")
    ctxs = sorted(set(ctxs))
    if hidden is None:
        h = synthetic_hidden(ctxs[-1], cfg, seed)
        source = f"synthetic: iid N(0, 1) tokens, seed {seed}; attention-only residual stream between layers"
    else:
        h, per_layer = read_hidden(hidden, cfg)
        T = h.shape[-2]
        if contexts is None:  # the defaults the file holds, else all of it: never refuse a length nobody asked for
            if T <= cfg.index_topk:
                raise ValueError(f"hidden: expected more than index_topk ({cfg.index_topk}) tokens (at or below it "
                                 f"top-k keeps every token), got {T} in {os.fspath(hidden)}")
            ctxs = [n for n in ctxs if n <= T] or [T]
        if ctxs[-1] > T:
            raise ValueError(f"context: {ctxs[-1]} exceeds the {T} tokens of --hidden {os.fspath(hidden)}")
        source = (f"{os.fspath(hidden)}: every layer's own input" if per_layer else
                  f"{os.fspath(hidden)}: the input of layer {ids[0]}; attention-only residual stream between layers")
        # only the chosen layers' rows and the tokens used: a saved HF dump of every layer can be large
        h = {l: h[l, :ctxs[-1]] for l in ids} if per_layer else h[:ctxs[-1]]
        if not all(torch.isfinite(t).all() for t in (h.values() if per_layer else [h])):
            raise ValueError(f"hidden: {os.fspath(hidden)} holds non-finite values in the rows used")
    loaded = load_layers(checkpoint, ids, device=dev, progress=progress)
    dtype = loaded.attention[ids[0]].q_a_proj.weight.dtype
    h = {l: t.to(dev, dtype) for l, t in h.items()} if isinstance(h, dict) else h.to(dev, dtype)
    rows = []
    for n in ctxs:
        t1 = time.perf_counter()
        q = min(queries, n - cfg.index_topk)
        with torch.no_grad():
            runs = run_context(loaded, h, n, q, backend=backend)
            rows += [measure(run, runs[i - 1] if i else None, cfg.selected_tokens) for i, run in enumerate(runs)]
        del runs
        if log:
            log(f"context {n}: {len(ids)} layer{'s' * (len(ids) > 1)} in {time.perf_counter() - t1:.1f} s")
    return {"checkpoint": os.fspath(checkpoint), "architectures": list(cfg.architectures), "layers": ids,
            "index_topk": cfg.index_topk, "device": str(dev), "kv_format": "bf16", "hidden": source,
            "contexts": ctxs, "queries": queries, "rows": rows, "seconds": round(time.perf_counter() - t0, 3)}


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _measured_rows(report: dict) -> str:
    """The query rows measured, from the rows themselves (``--queries`` is clipped to N - index_topk)."""
    per_context = {r["context"]: r["queries"] for r in report["rows"]}
    if len(set(per_context.values())) == 1:
        return f"the last {next(iter(per_context.values()))} query rows per context"
    return "the last " + ", ".join(f"{q} (N={n})" for n, q in sorted(per_context.items())) + " query rows"


def format_report(report: dict) -> str:
    """The report as a table: one line per layer and context (the fp8 indexer's overlap and reuse)."""
    head = (f"flashdsa report: {report['checkpoint']} ({', '.join(report['architectures'])}), layers "
            f"{report['layers'][0]}-{report['layers'][-1]}, index_topk {report['index_topk']}, "
            f"{_measured_rows(report)}, {report['device']}")
    cols = ("layer", "context", "mass exact", "mass fp8", "oracle", "fp8∩exact", "out diff fp8", "overlap prev",
            "reuse mass")
    keys = ("mass_exact", "mass_fp8", "mass_oracle", "fp8_recall", "out_diff_fp8", "overlap_prev_fp8", "reuse_mass_fp8")
    lines = [head, f"hidden: {report['hidden']}", "", "  ".join(f"{c:>12}" for c in cols)]
    for r in sorted(report["rows"], key=lambda r: (r["context"], r["layer"])):
        layer = f"{r['layer']}{' S' if r['skip_topk'] else ''}"
        lines.append("  ".join([f"{layer:>12}", f"{r['context']:>12}"] + [f"{_f(r[k]):>12}" for k in keys]))
    lines += ["", "mass: share of dense attention probability on the selected keys (mean over heads and rows); "
              "oracle: the best shared top-k;",
              "overlap prev / reuse mass: share of this layer's fp8 selection the previous layer made / this layer's "
              "mass on the previous layer's selection (what skip-top-k reuse would keep). S: a skip-top-k layer."]
    return "\n".join(lines)


def plot_report(report: dict, path: str | os.PathLike) -> bool:
    """Three panels against the layer, one line per context: captured mass (exact, fp8, oracle), output
    difference, overlap with the previous layer and reuse mass. False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for n in report["contexts"]:
        rows = sorted((r for r in report["rows"] if r["context"] == n), key=lambda r: r["layer"])
        layers = [r["layer"] for r in rows]
        line, = axes[0].plot(layers, [r["mass_exact"] for r in rows], "o-", label=f"N={n} exact")
        axes[0].plot(layers, [r["mass_fp8"] for r in rows], "s--", color=line.get_color(), label=f"N={n} fp8")
        axes[0].plot(layers, [r["mass_oracle"] for r in rows], ":", color=line.get_color(), label=f"N={n} oracle")
        axes[1].plot(layers, [r["out_diff_fp8"] for r in rows], "s--", color=line.get_color(), label=f"N={n} fp8")
        axes[1].plot(layers, [r["out_diff_exact"] for r in rows], "o-", color=line.get_color(), label=f"N={n} exact")
        later = [r for r in rows if r["overlap_prev_fp8"] is not None]
        axes[2].plot([r["layer"] for r in later], [r["overlap_prev_fp8"] for r in later], "o-", color=line.get_color(),
                     label=f"N={n} overlap")
        axes[2].plot([r["layer"] for r in later], [r["reuse_mass_fp8"] for r in later], "^:", color=line.get_color(),
                     label=f"N={n} reuse mass")
    titles = ("attention mass captured by top-k", "||sparse - dense|| / ||dense||", "vs the previous layer (fp8)")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['checkpoint']} (index_topk {report['index_topk']}; hidden: {report['hidden'][:60]})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
    return True

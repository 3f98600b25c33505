"""flashdsa report: its numbers against direct float64 computations, on a checkpoint written in the published
layout (tests/test_checkpoint.py) with the tiny preset's shapes.

* The measures (captured mass, oracle mass, overlaps, reuse mass, output difference) against loops over
  rows and heads in float64, on random inputs with -1 padded selections and chunked probabilities.
* The engine runs behind the report: each selection is a top-k of float64 scores recomputed from the
  indexer's own outputs (exact and fp8), tie-safe within the fp32 accumulation bound; a skip-top-k layer
  reuses its predecessor's; the dense and sparse outputs match float64 attention over all keys / over the
  selection within bf16 rounding; and the report's rows equal the loop measures of those runs.
* The command line: table, JSON, plot (or the line saying matplotlib is missing), one-line errors.
"""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest
import torch
from safetensors.torch import save_file

import flashdsa.report as rp
from flashdsa.cli import main
from flashdsa.engine import DSAModel
from flashdsa.layers import RMSNorm, RotaryEmbedding
from test_checkpoint import CFG, write_checkpoint

TOPK = CFG.index_topk          # 64
CONTEXTS = (80, 128)
Q = 8
LAYERS = [0, 1, 2, 3]          # layer 2 reuses layer 1's top-k
U_BF16 = 2.0 ** -8             # unit roundoff of bf16
U_F32 = 2.0 ** -24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_ckpt")
    write_checkpoint(root, DSAModel.random(CFG, seed=4))
    return root


@pytest.fixture(scope="module")
def per_layer_hidden(tmp_path_factory):
    """HF's output_hidden_states shape: num_hidden_layers + 1 entries, entry l entering layer l."""
    h = torch.randn(CFG.num_hidden_layers + 1, CONTEXTS[-1], CFG.hidden_size, generator=torch.Generator().manual_seed(11))
    path = tmp_path_factory.mktemp("hidden") / "hidden.pt"
    torch.save(h, path)
    return path, h


@pytest.fixture(scope="module")
def e2e(ckpt, per_layer_hidden):
    """One report over layers 0-3 with every layer's own input, and the engine runs behind it."""
    path, h = per_layer_hidden
    runs, loaded = {}, {}
    real = rp.run_context

    def spy(layers, hidden, context, queries, **kw):
        runs[context] = real(layers, hidden, context, queries, **kw)
        loaded["layers"] = layers
        return runs[context]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rp, "run_context", spy)
        report = rp.run_report(ckpt, "0-3", contexts=CONTEXTS, hidden=path, queries=Q)
    return report, runs, loaded["layers"], h


# ---- the measures against loops ------------------------------------------------------------------------

def _loop_measures(run: rp.LayerRun, prev: rp.LayerRun | None, topk: int) -> dict:
    """Every measure of the report, row by row and head by head, in float64."""
    Qn, h, _ = run.q.shape
    q, kv = run.q.double(), run.kv.double()
    acc = {k: 0.0 for k in rp.METRICS}
    for i in range(Qn):
        pos = int(run.positions[i])
        P = torch.stack([torch.softmax(kv[:pos + 1] @ q[i, j] * run.softmax_scale, 0) for j in range(h)])  # [h, pos+1]
        sets = {p: {int(x) for x in run.sel[p][i] if x >= 0} for p in rp.PRECISIONS}
        for p in rp.PRECISIONS:
            acc[f"mass_{p}"] += float(P[:, sorted(sets[p])].sum(1).mean()) / Qn
            if prev is not None:
                before = {int(x) for x in prev.sel[p][i] if x >= 0}
                acc[f"reuse_mass_{p}"] += float(P[:, sorted(before)].sum(1).mean()) / Qn
                acc[f"overlap_prev_{p}"] += len(before & sets[p]) / len(sets[p]) / Qn
        acc["mass_oracle"] += float(P.mean(0).sort(descending=True).values[:topk].sum()) / Qn
        acc["fp8_recall"] += len(sets["fp8"] & sets["exact"]) / len(sets["exact"]) / Qn
    for p in rp.PRECISIONS:
        d, o = run.out[p].double(), run.out_dense.double()
        acc[f"out_diff_{p}"] = float(torch.sqrt(((d - o) ** 2).sum() / (o ** 2).sum()))
        if prev is None:
            acc[f"overlap_prev_{p}"] = acc[f"reuse_mass_{p}"] = None
    return acc


def _assert_measures(row: dict, want: dict) -> None:
    for k in rp.METRICS:
        if want[k] is None:
            assert row[k] is None, k
        else:   # the same float64 sums in another order
            assert row[k] == pytest.approx(want[k], rel=1e-12, abs=1e-14), k


def _random_run(g: torch.Generator, N=50, Qn=6, h=3, D=16, k=8, layer=0) -> rp.LayerRun:
    positions = torch.tensor([N - 1, N - 2, 20, 9, 7, N - 3][:Qn])     # a row with fewer than k visible keys too
    sel = {}
    for p in rp.PRECISIONS:
        rows = []
        for pos in positions.tolist():
            pick = torch.randperm(pos + 1, generator=g)[:k].to(torch.int32)
            rows.append(torch.cat([pick, torch.full((k - pick.numel(),), -1, dtype=torch.int32)]))
        sel[p] = torch.stack(rows)
    out = torch.randn(Qn, 32, generator=g)
    return rp.LayerRun(layer=layer, context=N, skip=False, positions=positions,
                       q=torch.randn(Qn, h, D, generator=g).bfloat16(), kv=torch.randn(N, D, generator=g).bfloat16(),
                       out_dense=out.bfloat16(), out={p: (out + 0.3 * torch.randn(Qn, 32, generator=g)).bfloat16()
                                                      for p in rp.PRECISIONS},
                       sel=sel, softmax_scale=0.7)


@pytest.mark.parametrize("chunk_rows", [1, 4, None], ids=["chunk1", "chunk4", "one-chunk"])
def test_measures_equal_loops(monkeypatch, chunk_rows):
    if chunk_rows:
        monkeypatch.setattr(rp, "_PROB_BYTES", 8 * 3 * 50 * chunk_rows)
    g = torch.Generator().manual_seed(0)
    prev, run = _random_run(g), _random_run(g, layer=1)
    _assert_measures(rp.measure(prev, None, 8), _loop_measures(prev, None, 8))
    _assert_measures(rp.measure(run, prev, 8), _loop_measures(run, prev, 8))


def test_attention_probs_rows_sum_to_one_over_visible_keys():
    g = torch.Generator().manual_seed(1)
    run = _random_run(g)
    for rows, p in rp.attention_probs(run.q, run.kv, run.positions, run.softmax_scale):
        assert p.dtype == torch.float64
        assert torch.allclose(p.sum(-1), torch.ones_like(p[..., 0]), rtol=0, atol=1e-12)
        hidden = torch.arange(50)[None, :] > run.positions[rows, None]
        assert (p[hidden[:, None, :].expand_as(p)] == 0).all()


# ---- the engine runs behind the report ------------------------------------------------------------------

def _row_inputs(loaded, h, layer, N):
    attn = loaded.attention[layer]
    norm = RMSNorm(CFG.hidden_size, CFG.rms_norm_eps)
    norm.weight.data.copy_(loaded.input_layernorm[layer])
    xn = norm(h[layer, :N].bfloat16())
    cos, sin = RotaryEmbedding(CFG)(torch.arange(N))
    return attn, xn, cos, sin


def _check_topk(sel: torch.Tensor, s64: torch.Tensor, tol: torch.Tensor, positions: torch.Tensor, what: str) -> None:
    """Every row: TOPK distinct visible keys, each scoring at least every unselected visible key, up to ``tol``."""
    for i, pos in enumerate(positions.tolist()):
        chosen = sel[i].long()
        assert (chosen >= 0).all() and (chosen <= pos).all() and chosen.unique().numel() == TOPK, f"{what} row {i}"
        picked = torch.zeros(pos + 1, dtype=torch.bool)
        picked[chosen] = True
        lo = (s64[i, :pos + 1] + tol[i, :pos + 1])[picked].min()
        hi = (s64[i, :pos + 1] - tol[i, :pos + 1])[~picked].max()
        assert lo >= hi, f"{what} row {i}: a selected key scores below an unselected one beyond fp32 rounding"


def test_selections_are_the_top_k_of_the_indexer_scores(e2e):
    _, runs, loaded, h = e2e
    for N, layer_runs in runs.items():
        for j, run in enumerate(layer_runs):
            if run.skip:   # reuses the previous layer's, bit for bit
                for p in rp.PRECISIONS:
                    assert torch.equal(run.sel[p], layer_runs[j - 1].sel[p])
                continue
            attn, xn, cos, sin = _row_inputs(loaded, h, run.layer, N)
            _, _, qr = attn.prepare(xn, cos, sin)
            rows = run.positions
            for p in rp.PRECISIONS:
                attn.indexer.precision = p
                try:
                    idx = attn.indexer(xn, qr, cos, sin)
                finally:
                    attn.indexer.precision = "fp8"
                q, k, w = idx.q[rows].double(), idx.k.double(), idx.weights[rows].double()
                # SPEC §3 step 6 (fp8: the key's scale after the head sum); the exact indexer has no scales
                ks = idx.k_scale.double() if idx.k_scale is not None else torch.ones(N, dtype=torch.float64)
                s64 = torch.einsum("thd,nd->thn", q, k).relu().mul(w[:, :, None]).sum(1) * ks
                # fp32 accumulation over D products and H heads: |error| <= (D + H + 2) u_f32 sum |terms|
                mag = torch.einsum("thd,nd->thn", q.abs(), k.abs()).mul(w.abs()[:, :, None]).sum(1) * ks
                tol = (CFG.index_head_dim + CFG.index_n_heads + 2) * U_F32 * mag
                _check_topk(run.sel[p], s64, tol, rows, f"context {N} layer {run.layer} {p}")


def _attention64(run: rp.LayerRun, attn, keys: list[torch.Tensor]) -> torch.Tensor:
    """float64 MLA over each row's ``keys`` (positions), then W_uv and o_proj: ``[Q, hidden]``."""
    w = attn.kv_b_proj.weight.double().view(attn.h, attn.nope + attn.v, attn.kv_lora_rank)
    w_uv, w_o = w[:, attn.nope:], attn.o_proj.weight.double()
    outs = []
    for i, key in enumerate(keys):
        kv = run.kv[key].double()
        p = torch.softmax(run.q[i].double() @ kv.T * run.softmax_scale, -1)      # [h, n]
        lat = p @ kv[:, :attn.kv_lora_rank]                                      # [h, 512]
        outs.append(w_o @ torch.einsum("hc,hvc->hv", lat, w_uv).flatten())
    return torch.stack(outs)


def test_engine_outputs_match_float64_attention(e2e):
    """Dense output = attention over every visible key, sparse = over the selection, each to bf16 rounding:
    the latent output, the W_uv product and o_proj's output are each rounded to bf16 once (3 u), plus the
    fp32 softmax and accumulations well below that: 4 u."""
    _, runs, loaded, _ = e2e
    for N, layer_runs in runs.items():
        for run in layer_runs:
            attn = loaded.attention[run.layer]
            rows = run.positions.tolist()
            dense = _attention64(run, attn, [torch.arange(pos + 1) for pos in rows])
            err = (run.out_dense.double() - dense).norm() / dense.norm()
            assert err <= 4 * U_BF16, f"context {N} layer {run.layer} dense: {err:.2e}"
            for p in rp.PRECISIONS:
                sparse = _attention64(run, attn, [run.sel[p][i].long() for i in range(len(rows))])
                err = (run.out[p].double() - sparse).norm() / sparse.norm()
                assert err <= 4 * U_BF16, f"context {N} layer {run.layer} {p}: {err:.2e}"


def test_report_rows_equal_the_loop_measures(e2e):
    report, runs, _, _ = e2e
    assert report["layers"] == LAYERS and report["contexts"] == list(CONTEXTS) and report["index_topk"] == TOPK
    assert "every layer's own input" in report["hidden"]
    by_key = {(r["layer"], r["context"]): r for r in report["rows"]}
    assert len(by_key) == len(report["rows"]) == len(LAYERS) * len(CONTEXTS)
    for N, layer_runs in runs.items():
        assert [r.layer for r in layer_runs] == LAYERS
        for j, run in enumerate(layer_runs):
            row = by_key[(run.layer, N)]
            assert row["queries"] == Q and row["skip_topk"] == (run.layer == 2)
            assert run.positions.tolist() == list(range(N - Q, N))
            _assert_measures(row, _loop_measures(run, layer_runs[j - 1] if j else None, TOPK))
        # the skip layer keeps all of the previous pick; its reuse mass is its own mass
        skip = by_key[(2, N)]
        assert skip["overlap_prev_fp8"] == 1.0 and skip["reuse_mass_fp8"] == skip["mass_fp8"]
    # sanity of the numbers themselves: probabilities, a ceiling that holds
    for r in report["rows"]:
        for k in ("mass_exact", "mass_fp8"):
            assert 0 < r[k] <= r["mass_oracle"] + 1e-12 <= 1 + 1e-12
    json.dumps(report)  # JSON-ready


# ---- hidden states, the synthetic ones, the residual stream ------------------------------------------------------

def test_read_hidden_shapes(tmp_path):
    L, T, H = CFG.num_hidden_layers, 100, CFG.hidden_size
    x = torch.randn(L + 1, T, H)
    cases = {"a.pt": x, "b.pt": x[:, None], "c.pt": tuple(x), "d.pt": x[0], "e.pt": x[:1], "f.pt": x[:L]}
    for name, t in cases.items():
        torch.save(t, tmp_path / name)
        got, per_layer = rp.read_hidden(tmp_path / name, CFG)
        assert per_layer == (name not in ("d.pt", "e.pt")), name
        assert torch.equal(got, x[0] if not per_layer else x[:got.shape[0]]), name
    save_file({"hidden_states": x, "other": x[0].clone()}, str(tmp_path / "g.safetensors"))
    assert torch.equal(rp.read_hidden(tmp_path / "g.safetensors", CFG)[0], x)
    save_file({"a": x[0].clone(), "b": x[1].clone()}, str(tmp_path / "h.safetensors"))
    with pytest.raises(ValueError, match="hidden: .* expected one tensor or one named 'hidden_states'"):
        rp.read_hidden(tmp_path / "h.safetensors", CFG)
    for bad in (torch.randn(T, H + 1), torch.randn(3, T, H), torch.randint(0, 5, (T, H))):
        torch.save(bad, tmp_path / "bad.pt")
        with pytest.raises(ValueError, match=r"^hidden: expected"):
            rp.read_hidden(tmp_path / "bad.pt", CFG)
    (tmp_path / "junk.pt").write_text("not a tensor")
    with pytest.raises(ValueError, match="not a tensor saved with torch.save"):
        rp.read_hidden(tmp_path / "junk.pt", CFG)


def test_cli_synthetic_equals_the_same_tokens_from_a_file(ckpt, tmp_path, capsys):
    """The command line with synthetic tokens (seed 3) and the API with those tokens saved as [T, hidden] (the
    first layer's input, then the attention-only residual stream: layer 1 gets x + layer 0's dense output)
    give the same numbers; the same x saved for every layer ([L + 1, T, hidden]) changes layer 1 only."""
    out = tmp_path / "r.json"
    rc = main(["report", "--checkpoint", str(ckpt), "--layers", "0-1", "--context", "72", "--queries", "4",
               "--seed", "3", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "hidden: synthetic" in captured.out and "mass exact" in captured.out
    assert f"wrote {out}" in captured.err and "context 72: 2 layers" in captured.err
    cli = json.loads(out.read_text())
    x = rp.synthetic_hidden(72, CFG, 3)
    torch.save(x, tmp_path / "one.pt")
    api = rp.run_report(ckpt, "0-1", contexts=[72], hidden=tmp_path / "one.pt", queries=4)
    assert "the input of layer 0; attention-only residual stream" in api["hidden"]
    assert cli["rows"] == api["rows"]
    # the table shows the JSON's numbers
    for r in cli["rows"]:
        assert f"{r['mass_exact']:.3f}" in captured.out and f"{r['mass_oracle']:.3f}" in captured.out
    torch.save(x.expand(CFG.num_hidden_layers + 1, -1, -1).clone(), tmp_path / "all.pt")
    same = rp.run_report(ckpt, "0-1", contexts=[72], hidden=tmp_path / "all.pt", queries=4)["rows"]
    assert same[0] == cli["rows"][0]
    assert same[1]["mass_exact"] != cli["rows"][1]["mass_exact"]


# ---- the plot ---------------------------------------------------------------------------------------

class _FakeAxes:
    def __init__(self):
        self.lines = []

    def plot(self, x, y, *args, **kwargs):
        self.lines.append((list(x), list(y), kwargs.get("label")))
        return [types.SimpleNamespace(get_color=lambda: "C0")]

    def __getattr__(self, name):
        return lambda *a, **k: None


def _fake_matplotlib(saved: list):
    axes = [_FakeAxes() for _ in range(3)]
    fig = types.SimpleNamespace(suptitle=lambda *a, **k: None, tight_layout=lambda: None,
                                savefig=lambda path, **k: saved.append(path))
    plt = types.ModuleType("matplotlib.pyplot")
    plt.subplots = lambda *a, **k: (fig, axes)
    plt.close = lambda f: None
    mpl = types.ModuleType("matplotlib")
    mpl.use = lambda backend: None
    mpl.pyplot = plt
    return mpl, plt, axes


def test_plot_draws_the_report(e2e, monkeypatch):
    report = e2e[0]
    saved = []
    mpl, plt, axes = _fake_matplotlib(saved)
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    assert rp.plot_report(report, "out.png") and saved == ["out.png"]
    rows = sorted((r for r in report["rows"] if r["context"] == CONTEXTS[0]), key=lambda r: r["layer"])
    assert axes[0].lines[0] == (LAYERS, [r["mass_exact"] for r in rows], f"N={CONTEXTS[0]} exact")
    # the first layer has no previous one: the overlap panel starts at layer 1
    assert axes[2].lines[0][0] == LAYERS[1:]


def test_plot_without_matplotlib(e2e, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert rp.plot_report(e2e[0], tmp_path / "x.png") is False
    assert not (tmp_path / "x.png").exists()


# ---- command-line errors -------------------------------------------------------------------------------

def _one_line_error(capsys, argv: list[str]) -> str:
    rc = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2, (rc, err)
    assert captured.out == "" and "\n" not in err and "Traceback" not in err, err
    assert err.startswith("flashdsa report: ") or err.startswith("flashdsa: "), err
    return err


def _edited(ckpt, folder, **changes):
    """A copy of the checkpoint whose config.json says otherwise."""
    shutil.copytree(ckpt, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_cli_errors(ckpt, per_layer_hidden, tmp_path, capsys):
    kpool = _edited(ckpt, tmp_path / "kpool", index_kpool=4)
    narrow = _edited(ckpt, tmp_path / "narrow", kv_lora_rank=256)
    base = ["report", "--checkpoint", str(ckpt), "--layers", "0-1"]
    cases = [
        (["report", "--checkpoint", str(tmp_path / "none"), "--layers", "0"], r"--checkpoint: .*none is not a folder"),
        (["report", "--layers", "0-1"], r"the following arguments are required: --checkpoint"),
        (base[:3] + ["--layers", "2-3"], r"--layers: layer 2 reuses the top-k .* start the range at layer 1"),
        (base[:3] + ["--layers", "3-9"], r"--layers: expected 'A-B'"),
        (base + ["--context", "64"], r"--context: expected lengths > index_topk \(64\)"),
        (base + ["--context", "999", "--hidden", str(per_layer_hidden[0])], r"--context: 999 exceeds the 128 tokens"),
        (base + ["--hidden", str(tmp_path / "no.pt")], r"--hidden: .*no\.pt does not exist"),
        (base + ["--queries", "0"], r"--queries: expected an integer >= 1"),
        (base + ["--json", str(tmp_path / "no" / "r.json")], r"--json: the folder of .* does not exist"),
        (base + ["--device", "tpu"], r"--device: expected 'cpu', 'cuda' or 'cuda:N'"),
        (base + ["--seed", "-1"], r"--seed: expected an integer >= 0"),
        # kpool in the config without its tensors in the checkpoint: the loader names the first missing one
        (["report", "--checkpoint", str(kpool), "--layers", "0-1"], r"index_kpool_compress_gate"),
        (["report", "--checkpoint", str(narrow), "--layers", "0-1"], r"--checkpoint: the engine's caches need kv_lora_rank = 512 .* got 256 and 64"),
    ]
    torch.save(torch.randn(10, 7), tmp_path / "bad.pt")
    cases.append((base + ["--hidden", str(tmp_path / "bad.pt")], r"--hidden: expected \[T, 256\]"))
    nan = torch.randn(200, CFG.hidden_size)
    nan[70, 3] = float("nan")      # inside the 72 tokens used
    torch.save(nan, tmp_path / "nan.pt")
    cases.append((base + ["--context", "72", "--hidden", str(tmp_path / "nan.pt")], r"--hidden: .* non-finite values"))
    import re

    with pytest.MonkeyPatch.context() as mp:   # the suite sets TRITON_INTERPRET=1 for its own kernels
        mp.delenv("TRITON_INTERPRET", raising=False)
        err = _one_line_error(capsys, base + ["--backend", "triton"])
    assert "--backend: 'triton' needs --device cuda" in err, err
    for argv, pattern in cases:
        err = _one_line_error(capsys, argv)
        assert re.search(pattern, err), (argv, err)


def test_default_contexts_are_those_the_hidden_states_hold(ckpt, tmp_path):
    """Without --context the defaults (2, 4, 8 x index_topk = 128, 256, 512) are cut to the tokens of --hidden, or
    are all of them when it holds none: a length nobody asked for is never refused."""
    x = torch.randn(300, CFG.hidden_size, generator=torch.Generator().manual_seed(5))
    for T, want in ((300, [128, 256]), (100, [100])):
        torch.save(x[:T].clone(), tmp_path / f"h{T}.pt")
        report = rp.run_report(ckpt, "0", hidden=tmp_path / f"h{T}.pt", queries=4)
        assert report["contexts"] == want and sorted({r["context"] for r in report["rows"]}) == want
    torch.save(x[:TOPK].clone(), tmp_path / "short.pt")
    with pytest.raises(ValueError, match=r"^hidden: expected more than index_topk \(64\) tokens .* got 64 in "):
        rp.run_report(ckpt, "0", hidden=tmp_path / "short.pt")


def test_header_states_the_query_rows_measured(ckpt):
    """--queries is clipped to N - index_topk per context: the header says what was measured, not what was asked."""
    report = rp.run_report(ckpt, "0", contexts=[72, 80], queries=128)
    assert [r["queries"] for r in report["rows"]] == [8, 16]
    head = rp.format_report(report).splitlines()[0]
    assert "the last 8 (N=72), 16 (N=80) query rows," in head and "128" not in head, head
    one = rp.run_report(ckpt, "0", contexts=[72], queries=128)
    assert "the last 8 query rows per context," in rp.format_report(one).splitlines()[0]


def test_json_alone_prints_only_the_report(ckpt, capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc = main(["report", "--checkpoint", str(ckpt), "--layers", "0", "--context", "72", "--queries", "2", "--json",
               "--plot", str(tmp_path / "r.png")])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(captured.out)  # one JSON object and nothing else on stdout
    assert report["contexts"] == [72] and "wrote" not in captured.err
    # flashdsa is not on a package index: the hint names an install that works
    assert "no plot: matplotlib does not import (pip install matplotlib)" in captured.err, captured.err


def test_damaged_checkpoint_is_one_line(ckpt, tmp_path, capsys):
    """A NaN weight or a truncated shard: one line naming the tensor / the file, exit code 2, no figures."""
    from safetensors.torch import load_file

    nan = tmp_path / "nan"
    shutil.copytree(ckpt, nan)
    wm = json.loads((nan / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.q_a_proj.weight"
    tensors = load_file(str(nan / wm[name]))
    tensors[name].view(torch.uint8).fill_(0x7F)  # every fp8 code NaN
    save_file(tensors, str(nan / wm[name]))
    err = _one_line_error(capsys, ["report", "--checkpoint", str(nan), "--layers", "0-1", "--context", "72"])
    assert err.startswith(f"flashdsa report: --checkpoint: {name} in {wm[name]} holds") and "non-finite" in err, err
    cut = tmp_path / "cut"
    shutil.copytree(ckpt, cut)
    shard = cut / wm[name]
    shard.write_bytes(shard.read_bytes()[:100])
    err = _one_line_error(capsys, ["report", "--checkpoint", str(cut), "--layers", "0-1", "--context", "72"])
    assert err.startswith(f"flashdsa report: --checkpoint: {shard} is not a readable safetensors file"), err
    (tmp_path / "h.safetensors").write_bytes(b"")
    err = _one_line_error(capsys, ["report", "--checkpoint", str(ckpt), "--layers", "0-1", "--hidden",
                                   str(tmp_path / "h.safetensors")])
    assert "--hidden: " in err and "is not a readable safetensors file" in err, err


def test_report_on_a_glm5_next_checkpoint(tmp_path):
    """GLM-5.3-Flash's layout (transformers glm5_next, saved by HF): the hybrid stack's DSA layers (NoPE, kpool 16,
    a shared layer) report like any other; the oracle is the best ``index_topk + c - 1`` keys (kpool's widest
    selection), so no selection's mass exceeds it."""
    pytest.importorskip("transformers", minversion="5.23")
    pytest.importorskip("transformers.models.glm5_next")
    from test_hf_glm5_next import DSA_LAYERS, _model

    _model(seed=3).save_pretrained(tmp_path, max_shard_size="2MB")
    report = rp.run_report(tmp_path, f"{DSA_LAYERS[0]}-{DSA_LAYERS[-1]}", contexts=[128, 256], queries=16)
    rows = report["rows"]
    assert [r["layer"] for r in rows] == DSA_LAYERS * 2 and [r["skip_topk"] for r in rows[:3]] == [False, True, False]
    for r in rows:
        for p in ("exact", "fp8"):
            assert 0 < r[f"mass_{p}"] <= r["mass_oracle"] + 1e-9, r

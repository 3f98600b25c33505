"""``flashdsa bench``: the CPU message, the CPU check (tiny shapes, Triton interpreter vs torch), the rows /
table / JSON of a timed run (timer faked on CPU), the plot, argument errors; one GPU smoke run."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from flashdsa import bench as B
from flashdsa.bench import checks, runner
from flashdsa.testing import peers
from flashdsa.cli import main

HAS_CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="the CPU paths (no CUDA / interpreter) only")
CEILINGS = {"copy_GBps": 4270.0, "bf16_TFLOPs": 730.0, "fp8_TFLOPs": 1270.0}


def run_cli(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def fake_timer(monkeypatch, us=10.0):
    """Every timed call runs once and 'takes' ``us`` µs (so the timed path of the driver runs on CPU)."""
    calls = []

    def time_us(fn, graph=True):
        fn()
        calls.append(fn)
        return us
    monkeypatch.setattr(runner, "time_us", time_us)  # where run_case looks it up
    return calls


# ---- cases -----------------------------------------------------------------------------------------

def test_cases_cover_spec_shapes_and_quick_is_a_subset():
    full = B.cases()
    names = {c.name for c in full}
    for want in ("paged B64 n1 ctx~32K", "paged B64 n2 ctx~32K", "ragged 4096x16384", "top-2048 of [64, 32K]",
                 "top-2048 of [64, 128K]", "top-2048 of [4096, 8K]", "top-2048 of [4096, 32K]",
                 "decode fp8 B64 h128 top-2048 ctx 32K", "prefill bf16 T4096 N8K h128 top-2048",
                 "decode fp8 B64 s_q2 h128 top-2048 ctx 32K", "decode fp8 B128 s_q2 h64 top-2048 ctx 32K",
                 "decode bf16 B64 s_q1 h128 top-2048 ctx 32K",
                 "v32 decode B64 ctx 8K", "v32 decode B64 ctx 32K", "v32 prefill ctx 4K chunk 4K",
                 "v32 prefill ctx 32K chunk 4K", "v32 prefill ctx 128K chunk 4K"):
        assert want in names, want
    quick = B.cases(quick=True)
    assert {c.name for c in quick} < names
    assert {c.op for c in quick} == set(B.DEFAULT_OPS) - {"host"}  # host: no cases, flashdsa.testing.host_cost
    for sweep in B.PLOT_SWEEPS:  # the plot needs several context points in both modes
        assert len([c for c in quick if c.sweep == sweep]) >= 3
        assert all("ctx" in c.params for c in full if c.sweep == sweep)
    assert {c.kind for c in B.cases(tiny=True)} == set(B.SETUPS)  # the CPU check reaches every setup
    assert [c.op for c in B.cases(("topk",))] == ["topk"] * 4


def test_decode_grid_cases_and_parse_grid():
    assert "decode-grid" in B.OPS and "decode-grid" not in B.DEFAULT_OPS  # the grid runs when asked for
    full = [c for c in B.cases(("decode-grid",))]
    assert len(full) == 8 * 4 * 3 * 2 and {c.kind for c in full} == {"layer"}
    assert {(c.params["B"], c.params["h"], c.params["ctx"], c.params["n"]) for c in full} == {
        (b, h, ctx, n) for b in (1, 2, 4, 8, 16, 32, 64, 128) for h in (16, 32, 64, 128)
        for ctx in (8192, 32768, 131072) for n in (1, 2)}
    assert len(B.cases(("decode-grid",), quick=True)) == 4 * 2
    assert B.parse_grid("B=1, 4;h=16;ctx=32K,128k") == dict(B.GRID, B=(1, 4), h=(16,), ctx=(32768, 131072))
    assert B.parse_grid("") == B.GRID
    g = B.parse_grid("B=3;ctx=100;n=2")
    assert [c.name for c in B.cases(("decode-grid",), grid=g)][:2] == ["v32 decode B3 h16 n2 ctx 100",
                                                                     "v32 decode B3 h32 n2 ctx 100"]
    for bad in ("B=0", "x=1", "B", "B=1;h=", "ctx=32M", "n=-1"):
        with pytest.raises(ValueError, match="^grid:"):
            B.parse_grid(bad)


def test_parse_ops():
    assert B.parse_ops("topk, indexer") == ("indexer", "topk")  # run order, not argument order
    assert B.parse_ops(",".join(B.OPS)) == B.OPS
    for bad in ("", "flash", "topk,nope", ","):
        with pytest.raises(ValueError, match="ops"):
            B.parse_ops(bad)


# ---- the CPU paths ---------------------------------------------------------------------------------

@cpu_only
def test_cpu_says_what_it_would_measure_and_exits_0(capsys, tmp_path):
    path = tmp_path / "cpu.json"
    rc, out, _ = run_cli(["bench", "--quick", "--ops", "indexer,topk", "--json", str(path)], capsys)
    assert rc == 0
    assert "no CUDA" in out
    assert "paged B64 n1 ctx~32K" in out and "vs DeepGEMM" in out and "fast_topk" in out
    assert "decode fp8" not in out  # sparse_mla was not asked for
    assert "cannot measure" in out and "--cpu-check" in out
    assert "DeepGEMM: no" in out and "torch.topk: yes" in out  # which peers import here
    report = json.loads(path.read_text())
    assert report["measured"] is False and report["rows"] == []
    assert {c["op"] for c in report["cases"]} == {"indexer", "topk"}
    assert report["peers"]["torch.topk"]["ok"] is True


@cpu_only
def test_cpu_lists_the_host_cost_it_would_measure(capsys):
    rc, out, _ = run_cli(["bench", "--quick", "--ops", "host"], capsys)
    assert rc == 0 and "no CUDA" in out
    assert "host us per plain call of each op, contexts 32K  vs DeepGEMM, fast_topk_v2, FlashMLA" in out


@cpu_only
def test_cpu_check_quick_runs_every_op_and_reports_ok(capsys, tmp_path):
    path = tmp_path / "check.json"
    rc, out, _ = run_cli(["bench", "--cpu-check", "--quick", "--json", str(path), "--plot", str(tmp_path / "p.png")],
                         capsys)
    assert rc == 0, out
    assert "FAIL" not in out
    n = len(B.cases(quick=True, tiny=True)) + 3 + 4  # layer: 3 stages + step; prefill: 3 + last chunk + prompt
    assert f"cpu-check: {n}/{n} ok" in out
    assert "no plot: nothing was timed" in out and not (tmp_path / "p.png").exists()
    report = json.loads(path.read_text())
    assert report["ok"] is True and report["measured"] is False and report["ceilings"] is None
    assert report["device"]["name"] == "cpu"
    assert {r["op"] for r in report["rows"]} == set(B.DEFAULT_OPS) - {"host"}
    assert report["host"] == {"measured": False} and "host: nothing to check on the CPU" in out
    for r in report["rows"]:
        assert r["check"]["ok"] is True and "ours_us" not in r
    stages = [r["case"].split(": ")[-1] for r in report["rows"] if r["op"] == "layer"]
    assert stages == ["indexer", "top-k", "attention", "step"]
    stages = [r["case"].split(": ")[-1] for r in report["rows"] if r["op"] == "prefill"]
    assert stages == ["selection", "kv gather", "attention", "last chunk", "whole prompt (3 chunks)"]


@cpu_only
def test_cpu_check_of_the_decode_grid(capsys, tmp_path):
    """The grid's cells at tiny sizes: a head count and rows a request other than the preset's, checked."""
    path = tmp_path / "grid.json"
    rc, out, _ = run_cli(["bench", "--cpu-check", "--ops", "decode-grid", "--grid", "B=1,3;h=8;ctx=150;n=2",
                          "--json", str(path)], capsys)
    assert rc == 0, out
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 2 * 4 and all(r["check"]["ok"] for r in rows)
    assert {(r["params"]["B"], r["params"]["h"], r["params"]["n"]) for r in rows} == {(1, 8, 2), (3, 8, 2)}


@cpu_only
def test_cpu_check_fails_on_a_wrong_kernel(capsys, monkeypatch):
    """A top-k 'kernel' that drops its last pick must make the check FAIL and the exit code 1."""
    from flashdsa.ops import topk as topk_op
    good = topk_op._IMPLS["torch"]

    def broken(*args):
        out = good(*args)
        out[:, -1] = -1
        return out
    monkeypatch.setitem(topk_op._IMPLS, "triton", broken)
    rc, out, _ = run_cli(["bench", "--cpu-check", "--quick", "--ops", "topk"], capsys)
    assert rc == 1
    assert "FAIL (selections differ)" in out


@cpu_only
def test_cpu_check_of_decode_runs_the_kernels(capsys, monkeypatch):
    """On the CPU the decode and layer checks run the (interpreted) Triton kernels, not the torch default
    (which would compare the reference with itself): a decode 'kernel' that halves its output fails both."""
    from flashdsa.ops import sparse_mla
    good = sparse_mla._DECODE["torch"]

    def broken(*args, **kwargs):
        out, lse = good(*args, **kwargs)
        return out * 0.5, lse
    monkeypatch.setitem(sparse_mla._DECODE, "triton", broken)
    rc, out, _ = run_cli(["bench", "--cpu-check", "--ops", "sparse_mla,layer"], capsys)
    assert rc == 1
    bad = [line for line in out.splitlines() if "FAIL" in line]
    assert any("decode fp8" in line for line in bad) and any("decode bf16" in line for line in bad)
    assert any("attention" in line for line in bad), out
    assert not any("prefill" in line for line in bad)


def test_checks_can_fail():
    x = torch.randn(3, 50)
    assert checks._check_logits(x, x.clone())["ok"]
    y = x.clone()
    y[0, 0] = float("-inf")
    assert not checks._check_logits(y, x)["ok"]  # -inf pattern
    assert not checks._check_logits(x + 0.1 * torch.randn(3, 50), x)["ok"]  # cosine
    lengths = torch.tensor([50, 50, 20], dtype=torch.int32)
    top = torch.topk(torch.where(torch.arange(50) < lengths[:, None], x, float("-inf")), 8, dim=1).indices
    assert checks._topk_exact(x, lengths, top, 8)["exact"]
    worst = torch.argsort(x[:, :20], dim=1)[:, :1]  # swap one pick for the row's (in-range) lowest score
    assert not checks._topk_exact(x, lengths, torch.cat((top[:, 1:], worst), 1), 8)["exact"]
    assert not checks._topk_exact(x, lengths, torch.cat((top[:, :-1], top[:, :1]), 1), 8)["exact"]  # duplicate
    out, lse = torch.randn(2, 4, 16), torch.randn(2, 4)
    assert checks._check_attention(out, lse, out.clone(), lse.clone())["ok"]
    assert not checks._check_attention(out, lse + 0.01, out, lse)["ok"]


# ---- the timed path, timer faked ---------------------------------------------------------------------

@cpu_only
def test_timed_rows_table_and_roofline(monkeypatch):
    calls = fake_timer(monkeypatch, us=10.0)
    status = peers.peer_status()
    topk = [c for c in B.cases(tiny=True) if c.kind == "topk" and not c.params["pages"]][0]
    (row,) = B.run_case(topk, torch.device("cpu"), status, CEILINGS)
    R, L, k = topk.params["R"], topk.params["L"], topk.params["k"]
    assert row["ours_us"] == 10.0 and row["check"]["ok"]
    assert row["GBps"] == pytest.approx((4 * R * L + 4 * R * k) / 10.0 / 1e3)
    assert row["roof_us"] == pytest.approx((4 * R * L + 4 * R * k) / CEILINGS["copy_GBps"] / 1e3)
    assert [p["name"] for p in row["peers"]] == ["torch.topk"] and row["peers"][0]["ratio"] == 1.0
    assert len(calls) == 2  # ours and the peer

    layer = [c for c in B.cases(tiny=True) if c.kind == "layer"][0]
    rows = B.run_case(layer, torch.device("cpu"), status, CEILINGS)
    assert [r["check"]["ok"] for r in rows] == [True] * 4
    assert rows[-1]["roof_us"] == pytest.approx(sum(r["roof_us"] for r in rows[:3]))  # step = its stages
    assert rows[0]["TFLOPs"] > 0 and rows[1]["TFLOPs"] is None  # top-k moves bytes only

    # prefill: plain calls (its selection reads row bounds on the host), every chunk in the whole-prompt row
    graphs = []

    def time_us(fn, graph=True):
        graphs.append(graph)
        fn()
        return 10.0
    monkeypatch.setattr(runner, "time_us", time_us)
    prefill = [c for c in B.cases(tiny=True) if c.kind == "layer_prefill"][0]
    prows = B.run_case(prefill, torch.device("cpu"), status, CEILINGS)
    assert [r["check"]["ok"] for r in prows] == [True] * 5 and graphs == [False] * 5
    assert prows[3]["roof_us"] == pytest.approx(sum(r["roof_us"] for r in prows[:3]))  # the last chunk's stages
    assert "ours_MB" not in prows[0]  # peak memory is measured on CUDA only
    assert B.format_table(prows).count("\n") == 6

    table = B.format_table([row] + rows)
    head = table.splitlines()[0]
    for col in ("op", "case", "ours_us", "peer", "peer_us", "ours/peer", "GB/s", "TFLOP/s", "roof_us", "check"):
        assert col in head
    assert "torch.topk" in table and "ok (same bits)" in table and "ok (stages ok)" in table


def test_translated_topk_peer_helpers():
    # the per-token page table fast_topk_transform_fused reads: position p of request b -> its slot
    bt = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    table = checks._token_table(bt, 128)
    assert table.shape == (2, 128) and table.dtype == torch.int32
    assert table[0, 5] == 3 * 64 + 5 and table[0, 64] == 0 and table[1, 127] == 2 * 64 + 63
    # the peer's slots in its own order within a row: compared with ours as sets
    mine = torch.tensor([[1, 5, 9], [2, 4, 6]])
    assert checks._same_slot_sets(torch.tensor([[9, 1, 5], [6, 2, 4]]), mine)["summary"].startswith(
        "same slots (as sets) in 100.0%")
    assert "in 50.0%" in checks._same_slot_sets(torch.tensor([[9, 1, 5], [6, 2, 7]]), mine)["summary"]


@cpu_only
def test_translating_topk_peer_wired_into_the_layer_and_selection(monkeypatch):
    # sgl-kernel's fast_topk_transform_fused (absent on the CPU) stood in for by torch: the top-k over the
    # row's length, translated through the per-token table, -1 past it, in an order of its own (reversed)
    from flashdsa.config import DSAConfig

    def fake(lengths, token_table, k):
        def call(scores):
            pos = torch.arange(scores.shape[1])
            x = torch.where(pos[None, :] < lengths[:, None], scores, float("-inf"))
            top = torch.topk(x, min(k, x.shape[1]), dim=1).indices
            slots = torch.where(torch.gather(x, 1, top) > float("-inf"), torch.gather(token_table, 1, top), -1)
            out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
            out[:, :slots.shape[1]] = slots.flip(1)
            return out
        return call
    monkeypatch.setattr(peers, "fast_topk_transform_fused", fake)
    preset = DSAConfig.preset
    monkeypatch.setattr(DSAConfig, "preset", classmethod(lambda cls, name: preset(name).replace(index_topk=2048)))
    fake_timer(monkeypatch, us=10.0)
    status = {name: dict(v) for name, v in peers.peer_status().items()}
    status["fast_topk_transform_fused"] = {"ok": True, "why": "a torch stand-in"}
    layer = B.Case("layer", "layer", "tiny decode B2 ctx 200 top-2048", dict(preset="tiny", B=2, ctx=200))
    rows = B.run_case(layer, torch.device("cpu"), status, CEILINGS)
    topk_row = [r for r in rows if r["case"].endswith("top-k")][0]
    assert [p["name"] for p in topk_row["peers"]] == ["fast_topk_transform_fused"]
    assert topk_row["peers"][0]["check"]["summary"] == "same slots (as sets) in 100.0% of rows"


def test_roof_us_memory_or_compute_bound():
    mem = B.Bench(None, None, bytes=4.27e9, flops=1e9, dtype="fp8")  # 1 ms of copy, ~1 µs of fp8 math
    assert B.roof_us(mem, CEILINGS) == pytest.approx(1000.0)
    math = B.Bench(None, None, bytes=1e6, flops=7.3e11, dtype="bf16")  # 1 ms of bf16 math
    assert B.roof_us(math, CEILINGS) == pytest.approx(1000.0)
    assert B.roof_us(B.Bench(None, None, parts=(mem, math)), CEILINGS) == pytest.approx(2000.0)
    assert B.roof_us(mem, {}) is None


def test_json_structure(tmp_path):
    rows = [{"op": "topk", "case": "c", "ours_us": 12.5, "peers": [{"name": "torch.topk", "us": 20.0, "ratio": 0.625}],
             "check": {"ok": True, "summary": "same bits"}, "params": {"R": 64, "dtype": torch.float32}}]
    path = tmp_path / "r.json"
    B.write_json({"device": {"name": "x"}, "ceilings": CEILINGS, "rows": rows, "ok": True}, str(path))
    got = json.loads(path.read_text())
    assert got["rows"][0]["peers"][0]["ratio"] == 0.625 and got["ceilings"] == CEILINGS
    assert got["rows"][0]["params"]["dtype"] == "torch.float32"  # anything else is written as text


# ---- the plot ----------------------------------------------------------------------------------------

def sweep_rows():
    rows = []
    for ctx in (4096, 16384, 32768, 65536):
        rows.append({"op": "indexer", "case": f"paged {ctx}", "sweep": "indexer_paged", "context": ctx,
                     "ours_us": ctx / 400, "roof_us": ctx / 500, "check": {"ok": True},
                     "peers": [{"name": "DeepGEMM", "us": ctx / 380, "ratio": 0.95}]})
        rows.append({"op": "sparse_mla", "case": f"decode {ctx}", "sweep": "sparse_decode", "context": ctx,
                     "ours_us": 100.0, "roof_us": 60.0, "check": {"ok": True},
                     "peers": [{"name": "FlashMLA", "error": "RuntimeError"}]})  # a failed peer is left out
    return rows


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert B.plot(sweep_rows(), CEILINGS, str(path), title="synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    only_topk = tmp_path / "empty.png"  # no sweep rows: both panels say "not measured"
    assert B.plot([{"op": "topk", "case": "c", "ours_us": 1.0, "peers": []}], CEILINGS, str(only_topk))
    assert only_topk.exists()


def grid_rows():
    rows = []
    for b in (1, 4):
        for h in (16, 128):
            for stage in ("indexer", "step"):
                rows.append({"op": "decode-grid", "case": f"v32 decode B{b} h{h} n1 ctx 32K: {stage}",
                             "params": dict(preset="v32", B=b, h=h, n=1, ctx=32768), "ours_us": 10.0 * b,
                             "check": {"ok": True}, "peers": [{"name": "chain", "us": 9.0, "ratio": 10 * b / 9}]})
    rows[-1]["peers"] = [{"name": "chain", "error": "RuntimeError"}]  # a cell without the peers' time
    return rows


def test_grid_ratios_and_heat_map(tmp_path):
    grid = B.grid_ratios(grid_rows() + sweep_rows())
    assert list(grid) == [(32768, 1)]
    assert grid[(32768, 1)] == {(1, 16): 10 / 9, (1, 128): 10 / 9, (4, 16): 40 / 9, (4, 128): None}
    pytest.importorskip("matplotlib")
    only = tmp_path / "grid.png"
    assert B.plot(grid_rows(), CEILINGS, str(only)) == [str(only)]
    assert only.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    both = tmp_path / "all.png"
    assert B.plot(grid_rows() + sweep_rows(), CEILINGS, str(both)) == [str(both), str(tmp_path / "all_grid.png")]
    assert (tmp_path / "all_grid.png").stat().st_size > 10_000


def test_from_json_redraws_table_and_plot(tmp_path, capsys):
    report = {"device": {"name": "H200"}, "date": "2026-11-29T10:00:00", "ceilings": CEILINGS, "measured": True,
              "ok": True, "rows": sweep_rows()}
    path = tmp_path / "gpu.json"
    B.write_json(report, str(path))
    png = tmp_path / "from.png"
    rc, out, _ = run_cli(["bench", "--from-json", str(path), "--plot", str(png)], capsys)
    assert rc == 0
    assert "paged 32768" in out and "DeepGEMM" in out and "4.27 TB/s" in out
    assert out.splitlines()[3].startswith("---")  # the Markdown header rule under the column names
    has_mpl = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        has_mpl = False
    assert png.exists() == has_mpl
    assert ("wrote" in out) == has_mpl and ("matplotlib does not import" in out) != has_mpl
    path.write_text("{not json")
    rc, out, err = run_cli(["bench", "--from-json", str(path)], capsys)
    assert rc == 2 and err.startswith("flashdsa bench: --from-json:")


@cpu_only
def test_json_alone_prints_only_the_json_object(capsys):
    rc, out, err = run_cli(["bench", "--quick", "--ops", "topk", "--json"], capsys)
    assert rc == 0, err
    report = json.loads(out)  # one JSON object and nothing else on stdout: the table is not printed
    assert report["measured"] is False and {c["op"] for c in report["cases"]} == {"topk"}
    rc, out, err = run_cli(["bench", "--from-json", "r.json", "--json"], capsys)
    assert rc == 2 and err.startswith("flashdsa bench: --json: --from-json measures nothing"), err


def test_missing_matplotlib_names_an_install_that_works(tmp_path, monkeypatch, capsys):
    """flashdsa is not on a package index: 'pip install flashdsa[bench]' cannot work, matplotlib itself can."""
    path = tmp_path / "gpu.json"
    B.write_json({"device": {"name": "H200"}, "date": "2026-11-29", "ceilings": CEILINGS, "measured": True,
                  "ok": True, "rows": sweep_rows()}, str(path))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, out, _ = run_cli(["bench", "--from-json", str(path), "--plot", str(tmp_path / "x.png")], capsys)
    assert rc == 0 and "no plot: matplotlib does not import (pip install matplotlib)" in out, out


def test_plot_without_matplotlib_says_no(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert B.plot(sweep_rows(), CEILINGS, str(tmp_path / "x.png")) is False
    assert not (tmp_path / "x.png").exists()


# ---- arguments and peers -----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, name", [
    (["--ops", "indexer,flash"], "ops"),
    (["--json", "/no/such/folder/out.json"], "json"),
    (["--plot", "/no/such/folder/out.png"], "plot"),
    (["--peer-libs", "/no/such/folder"], "peer-libs"),
    (["--ops", "decode-grid", "--grid", "B=1;q=2"], "grid"),
    (["--ops", "layer", "--grid", "B=1"], "grid"),
], ids=["ops", "json", "plot", "peer-libs", "grid", "grid-without-the-op"])
def test_bad_arguments_exit_2_naming_the_argument(argv, name, capsys):
    rc, out, err = run_cli(["bench", *argv], capsys)
    assert rc == 2
    assert err.startswith(f"flashdsa bench: --{name}:")  # the message names the flag
    assert out == ""  # nothing ran


def test_unknown_option_exits_2(capsys):
    rc, out, err = run_cli(["bench", "--fast"], capsys)
    assert rc == 2 and "--fast" in err and len(err.strip().splitlines()) == 1


def test_peer_libs_folder_without_libraries(tmp_path, monkeypatch):
    if hasattr(torch.ops.sgl_kernel, "sparse_decode_fwd"):
        pytest.skip("sgl-kernel's ops are already loaded in this process")
    status = peers.peer_status(str(tmp_path))
    assert status["FlashMLA"]["ok"] is False and "no *.so" in status["FlashMLA"]["why"]
    assert status["torch.topk"]["ok"] is True
    monkeypatch.setenv("FLASHDSA_SGL_KERNEL_LIBS", str(tmp_path))  # the env var is the default folder
    assert str(tmp_path) in peers.peer_status()["fast_topk"]["why"]


# ---- GPU -----------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_quick_topk_is_timed_and_checked(capsys, tmp_path):
    path = tmp_path / "gpu.json"
    rc, out, _ = run_cli(["bench", "--quick", "--ops", "topk", "--json", str(path)], capsys)
    assert rc == 0, out
    report = json.loads(path.read_text())
    assert report["measured"] is True and report["ceilings"]["copy_GBps"] > 100
    assert report["ceilings"]["bf16_TFLOPs"] > 1
    for r in report["rows"]:
        assert r["check"]["ok"] and r["ours_us"] > 0 and r["roof_us"] > 0
        assert any(p["name"] == "torch.topk" and p["us"] > 0 for p in r["peers"])

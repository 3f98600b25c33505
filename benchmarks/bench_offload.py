"""Host offload of the MLA cache ("HiSparse", issue 22) against the all-on-device cache, on the GPU.

    PYTHONPATH=. python benchmarks/bench_offload.py [--preset v32] [--layers 2] [--batch 8] [--contexts 32768,131072]
                                                   [--device-buffer 4096] [--budget-gb 100] [--steps 20]
    PYTHONPATH=. python benchmarks/bench_offload.py --smoke     # tiny preset on the CPU: checks the script

Per context (every request holds that many tokens): two runners over the same seeded random model (the
preset's shapes cut to ``--layers`` layers) and the same cache contents — MLA rows and indexer keys
written directly (random, not prefilled: a 128K prefill per request would dominate the run) — one all on
the device, one with the MLA cache in pinned host memory and ``--device-buffer`` rows per request and
layer on the device. Both decode the same greedy tokens; every step's logits must be bitwise equal.

Columns, one row per (context, mode):
    dev_MB/req       device KV bytes per request, measured (torch.cuda.memory_allocated around the pool's
                     construction, / batch; on the CPU the pool's own accounting), at the bench's layers;
                     dev_MB/req_formula: the formula at the pool's capacity per request (context + steps,
                     whole pages)
    dev_MB/req_full  the same by formula for the whole preset (all its layers); host_MB/req_full likewise
    max_batch        the most requests of this context whose device KV fits --budget-gb (whole preset)
    step_ms          median decode step (eager: offload cannot be captured in a CUDA graph), after
                     --warmup steps that fill the buffers
    swap_tok/step    rows copied host -> device per step, all layers and requests (median)
    swap_MB/step     the same in bytes; swap_ms@h2d: their time at the measured pinned H2D bandwidth
                     (an ideal copy; the swap-in also gathers on the host and syncs once per layer)
    bitwise          every step's logits equal to the on-device runner's
Rows go to $OUT/bench_offload.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import print_table, write_json

from flashdsa.cache import layouts
from flashdsa.cache.offload import OffloadConfig
from flashdsa.config import DSAConfig
from flashdsa.demo import demo_config
from flashdsa.engine import DSAModel, Runner
from flashdsa.quant import act_quant

MB = 2 ** 20
FILL_CHUNK = 8192  # tokens written per call while filling the caches (bounds the random temporaries)


def device_bytes_per_request(cfg: DSAConfig, context: int, kv_format: str, rows: int | None) -> int:
    """Device KV bytes one request of ``context`` tokens holds: all MLA rows + indexer keys on the device
    (``rows`` None), or with offload the indexer keys, ``rows`` buffer rows per layer and the resident map
    (``flashdsa.cache.offload.ResidentMap``: int32 per pool slot, int32 + int64 per buffer row, per layer)."""
    L, width = cfg.num_hidden_layers, layouts.BYTES_PER_TOKEN[kv_format]
    index = len(cfg.topk_layers) * layouts.INDEX_BYTES_PER_TOKEN * context
    if rows is None:
        return L * width * context + index
    return index + L * (rows * width + 4 * context + 12 * rows)


def host_bytes_per_request(cfg: DSAConfig, context: int, kv_format: str) -> int:
    return cfg.num_hidden_layers * layouts.BYTES_PER_TOKEN[kv_format] * context


def h2d_gbps(dev: torch.device) -> float | None:
    """Pinned host -> device copy bandwidth (GB/s) of a 256 MB buffer, median of 10; None without CUDA."""
    if dev.type != "cuda":
        return None
    src = torch.empty(256 * MB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=dev)
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return src.numel() / statistics.median(times) / 1e9


def allocated(dev: torch.device) -> int:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return torch.cuda.memory_allocated(dev)
    return 0


def make_runner(model, pages: int, kv_format: str, offload: OffloadConfig | None, dev: torch.device):
    """A runner and its pool's device bytes (measured on CUDA, the pool's accounting on the CPU)."""
    before = allocated(dev)
    run = Runner(model, pages, kv_format, dense_threshold=0 if offload is None else None, offload=offload,
                 kv_scale=1 / 32 if kv_format == "fp8_raw" else None)
    mem = run.pool.memory_bytes()
    device = (allocated(dev) - before) if dev.type == "cuda" else mem.get("device", mem["total"])
    return run, device


def fill(runners: list[Runner], cfg: DSAConfig, batch: int, context: int, dev: torch.device, seed: int) -> None:
    """Reserve ``context`` tokens for requests 0 .. batch - 1 in every runner and write the same random MLA
    rows and indexer keys into each."""
    g = torch.Generator(device=dev).manual_seed(seed)
    for r in range(batch):
        for run in runners:
            run.alloc.reserve({r: context})
        slots = runners[0].pool.slots(r)
        assert all(torch.equal(slots, run.pool.slots(r)) for run in runners[1:])
        for layer in range(cfg.num_hidden_layers):
            for c0 in range(0, context, FILL_CHUNK):
                s = slots[c0:c0 + FILL_CHUNK]
                kv = torch.randn(s.numel(), layouts.MLA_DIM, generator=g, device=dev).to(torch.bfloat16)
                keys = ()
                if runners[0].pool.has_index_cache(layer):
                    k, scale = act_quant(torch.randn(s.numel(), layouts.INDEX_DIM, generator=g, device=dev), block=128)
                    keys = (k, scale.squeeze(-1))
                for run in runners:
                    run.pool.write(layer, s, kv, *keys)


def timed_decode(run: Runner, tokens: dict, dev: torch.device) -> tuple[torch.Tensor, float]:
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        a.record()
        out = run.decode(tokens)
        b.record()
        torch.cuda.synchronize(dev)
        return out, a.elapsed_time(b)
    t = time.perf_counter()
    out = run.decode(tokens)
    return out, 1e3 * (time.perf_counter() - t)


def bench_context(model, cfg: DSAConfig, full: DSAConfig, args, context: int, dev: torch.device,
                  bw: float | None) -> list[dict]:
    steps = args.warmup + args.steps
    pages = args.batch * -(-(context + steps) // cfg.page_size)
    rows = OffloadConfig(device_buffer=args.device_buffer).rows(cfg.index_topk)
    on, on_dev = make_runner(model, pages, args.kv_format, None, dev)
    off, off_dev = make_runner(model, pages, args.kv_format,
                               OffloadConfig(device_buffer=rows, max_requests=args.batch), dev)
    fill([on, off], cfg, args.batch, context, dev, seed=context)
    tokens = {r: r % cfg.vocab_size for r in range(args.batch)}
    t_on, t_off, swaps, bitwise = [], [], [], True
    for i in range(steps):
        before = off.pool.stats.get("decode", {}).get("rows", 0)
        a, ms_on = timed_decode(on, tokens, dev)
        b, ms_off = timed_decode(off, tokens, dev)
        bitwise &= torch.equal(a, b)
        if i >= args.warmup:
            t_on.append(ms_on)
            t_off.append(ms_off)
            swaps.append(off.pool.stats["decode"]["rows"] - before)
        tokens = {r: int(t) for r, t in zip(tokens, a.argmax(-1).tolist())}
    off.pool.resident.check()
    width = layouts.BYTES_PER_TOKEN[args.kv_format]
    capacity = pages * cfg.page_size // args.batch
    swap_tok = statistics.median(swaps)
    common = dict(context=context, batch=args.batch, layers=cfg.num_hidden_layers)
    out = []
    for mode, dev_bytes, t, buf in (("on_device", on_dev, t_on, None), ("offload", off_dev, t_off, rows)):
        per_req_full = device_bytes_per_request(full, context, args.kv_format, buf)
        row = dict(common, mode=mode, device_buffer=buf or "", **{
            "dev_MB/req": dev_bytes / args.batch / MB,
            "dev_MB/req_formula": device_bytes_per_request(cfg, capacity, args.kv_format, buf) / MB,
            "dev_MB/req_full": per_req_full / MB,
            "host_MB/req_full": host_bytes_per_request(full, context, args.kv_format) / MB if buf else 0.0,
            "max_batch": int(args.budget_gb * 1e9 // per_req_full),
            "step_ms": statistics.median(t)})
        if buf:
            row.update({"swap_tok/step": swap_tok, "swap_MB/step": swap_tok * width / MB,
                        "swap_ms@h2d": swap_tok * width / (bw * 1e9) * 1e3 if bw else "n/a",
                        "bitwise": bitwise})
        out.append(row)
    del on, off
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v32", help="model shapes (v32, glm5, tiny)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the bench model (>= 3 keeps a skip-top-k layer)")
    ap.add_argument("--batch", type=int, default=8, help="requests decoding together")
    ap.add_argument("--contexts", default="32768,131072", help="tokens per request, comma-separated")
    ap.add_argument("--device-buffer", type=int, default=None, help="rows per request and layer (default 2 topk)")
    ap.add_argument("--kv-format", default="fp8", choices=list(layouts.MLA_FORMATS))
    ap.add_argument("--budget-gb", type=float, default=100.0, help="device memory for KV, for max_batch")
    ap.add_argument("--warmup", type=int, default=5, help="untimed decode steps (fill the buffers)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps")
    ap.add_argument("--smoke", action="store_true", help="tiny preset, short contexts, CPU ok: checks the script")
    ap.add_argument("--json", default=None, help="write the rows here (default $OUT/bench_offload.json)")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.layers, args.batch, args.contexts = "tiny", 3, 2, "256,512"
        args.warmup, args.steps, args.budget_gb = 2, 3, 1.0
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cfg, full = demo_config(args.preset, args.layers), DSAConfig.preset(args.preset)
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"[bench_offload] {args.preset} cut to {cfg.num_hidden_layers} layers, batch {args.batch}, "
          f"contexts {contexts}, {args.kv_format}, on {dev}")
    model = DSAModel.random(cfg, seed=0, device=dev)
    bw = h2d_gbps(dev)
    print(f"[bench_offload] pinned H2D bandwidth: {'n/a' if bw is None else f'{bw:.1f} GB/s'}")
    rows = []
    for context in contexts:
        rows += bench_context(model, cfg, full, args, context, dev, bw)
        print(f"[bench_offload] context {context} done")
    print_table(rows, f"offload vs on device ({args.preset}, {dev})")
    write_json(rows, "bench_offload", args.json)
    if not all(r.get("bitwise", True) for r in rows):
        raise SystemExit("offload logits differ from the on-device logits")


if __name__ == "__main__":
    main()

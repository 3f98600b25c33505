"""Where an eager (``cuda_graphs=False``) flashdsa.hf decode step spends its host time, beside HF eager (#40).

    PYTHONPATH=. python benchmarks/hf_eager_profile.py [--prompt 4096] [--batch 1]

bench_hf's random bf16 V3.2 (4 layers). Per implementation: ms per decode step (plain forwards with a cache,
the best of three rounds of 20 steps, each synchronised once), kernels a step and their summed GPU time
(torch.profiler), and for flashdsa cProfile's cumulative host time per function over one step.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import bench_hf as bh
import flashdsa.hf as fh
from flashdsa import ops


def steps(model, ids, n: int, profile: bool = False):
    from transformers import DynamicCache
    with torch.no_grad():
        cache = fh.FlashDSACache(model) if fh.get_patch(model) is not None else DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        B, L = ids.shape
        mask = torch.ones(B, L + 1, dtype=torch.long, device=ids.device)

        def step(tok, mask):
            o = model(input_ids=tok, attention_mask=mask, past_key_values=cache, use_cache=True)
            return o.logits[:, -1:].argmax(-1), torch.ones(B, mask.shape[1] + 1, dtype=torch.long, device=ids.device)

        for _ in range(5):
            tok, mask = step(tok, mask)
        times = []
        for _ in range(3):  # the best of three rounds: this host's timing moves by tens of per cent
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                tok, mask = step(tok, mask)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / n * 1e3)
        ms = min(times)
        from torch.profiler import ProfilerActivity, profile as prof
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(4):
                tok, mask = step(tok, mask)
            torch.cuda.synchronize()
        ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels, gpu_us = len(ev) / 4, sum(e.device_time for e in ev) / 4
        text = None
        if profile:
            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            for _ in range(4):
                tok, mask = step(tok, mask)
            torch.cuda.synchronize()
            pr.disable()
            s = io.StringIO()
            st = pstats.Stats(pr, stream=s)
            st.sort_stats("cumulative").print_stats(45)
            st.sort_stats("tottime").print_stats(25)
            text = s.getvalue()
        return ms, kernels, gpu_us, text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    model = bh.build(bh.MODEL, "cuda", torch.bfloat16)
    ids = torch.randint(1, bh.MODEL["vocab_size"], (args.batch, args.prompt), device="cuda")
    ops.set_value_checks(False)
    rows = []
    for impl in ("hf-eager", "fd-fp8-eager-torch-rows", "fd-fp8-eager", "fd-fp8"):
        kw = bh.IMPLS[impl.replace("-torch-rows", "")]
        if kw is not None:
            patch = fh.apply(model, max_tokens=args.batch * (args.prompt + 256), **kw)
            for attn in patch.attentions:  # the torch ops instead of layers.mla_rows' kernel
                attn.fused_rows = not impl.endswith("-torch-rows")
        ms, k, g, text = steps(model, ids, args.steps, profile=impl == "fd-fp8-eager")
        if kw is not None:
            fh.unapply(model)
        rows.append((impl, ms, k, g))
        if text:
            print(text)
    print(f"prompt {args.prompt} batch {args.batch}")
    print("impl | ms/step | kernels/step | GPU us/step")
    for impl, ms, k, g in rows:
        print(f"{impl} | {ms:.2f} | {k:.0f} | {g:.0f}")


if __name__ == "__main__":
    main()

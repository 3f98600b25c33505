"""Where a DeepSeek-V4-Flash layer's decode step spends its GPU time (issue #43): each layer type and precision,
the capturable step replayed from a CUDA graph (median µs) and torch.profiler's CUDA kernels of 5 eager calls.

    PYTHONPATH=. python benchmarks/v4_layer_profile.py B L      # e.g. 2 4096

The layers are flashdsa.demo.v4's (the release's attention shapes, default initialisation, bf16), prefilled with
L tokens of HF's own inputs. On an H100 (2026-12-07, B 2, L 4096) a CSA layer's fp8 step replayed in 897 µs, of
which ~120 µs are the projections' GEMMs (near their weights' bytes at copy speed) and the rest ~180 small
elementwise / index kernels a step (RoPE, the compressors' closing windows, fp8 encodes); the HCA layer's gate
softmax over its 128-slot window (softmax over a non-last dim, as HF writes it) alone took 71 µs. With the fp8
mode's decode kernels (flashdsa/v4/close_entry.py, rope.py, the indexer quant) the fp8 steps replayed in 259 /
471 / 438 µs (sliding / CSA / HCA; were 320 / 897 / 554).
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flashdsa.demo.v4 import _hf_model, _hf_run
from flashdsa.testing.timing import time_us
from flashdsa.v4.config import V4Config
from flashdsa.v4.layer import V4LayerStep


def main() -> None:
    if len(sys.argv) != 3 or not torch.cuda.is_available():
        sys.exit("usage (on a CUDA device): v4_layer_profile.py B L")
    B, L = int(sys.argv[1]), int(sys.argv[2])
    dev = torch.device("cuda")
    model = _hf_model(V4Config.preset("v4-flash"), 0, dev).to(torch.bfloat16)
    ids = torch.randint(1, 256, (B, L + 1), device=dev)
    calls = _hf_run(model, [ids[:, :L], ids[:, L:]], dev)
    for prec in ("fp8", "exact"):
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            step = V4LayerStep(attn, None, prec)
            prompt = calls[0][i][0]
            cos, sin = (t[0] for t in prompt["position_embeddings"][attn.rope_layer_type])
            _, state = step(prompt["hidden_states"], prompt["position_ids"][0], cos, sin,
                            step.empty_state(B, torch.bfloat16, dev))
            state = step.reserve(state, L + 1)
            d = calls[1][i][0]
            cos, sin = (t[0] for t in d["position_embeddings"][attn.rope_layer_type])

            def one():
                return step.decode(d["hidden_states"], d["position_ids"][0], cos, sin, state, capturable=True)
            us = time_us(one)
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(5):
                    one()
                torch.cuda.synchronize()
            print(f"==== {prec} {attn.layer_type} B{B} L{L}: graph replay {us:.0f} us")
            print("\n".join(p.key_averages().table(sort_by="cuda_time_total", row_limit=14).splitlines()[:18]))


if __name__ == "__main__":
    main()

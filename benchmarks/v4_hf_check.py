"""Where flashdsa's DeepSeek-V4 path leaves HF's numbers, and whether its decode step captures: a diagnosis for
the GPU box (issue #43), no timing.

    PYTHONPATH=. python benchmarks/v4_hf_check.py [--prompt 3072] [--smoke]

1. Every attention layer of ``bench_hf.py``'s V4 model (fp32, default initialisation) on a ``--prompt``-token
   prompt: HF's output against ``V4LayerStep``'s on the very inputs HF's layer got, with the default backend and
   with ``backend="torch"``; max |diff| / max |HF| and the position where it peaks (``bench_hf.v4_layer_errors``).
   On this model at 3072 tokens on a CPU every layer is at fp32 rounding (<= 5.6e-7, 2026-12-07) while the whole
   model is 1.7e-3 from HF: later layers see hidden states rounded differently and a near-tie at the top-k
   boundary picks another entry. A row far above rounding whose torch-backend twin is at rounding points at a
   kernel; both far above points at the selection (scores not bitwise HF's on HF's own inputs).
2. ``flashdsa.hf`` decode from CUDA graphs on a tiny model, exact (fp32) and fp8 (bf16): whether the capture
   worked, and if not the traceback of the op that broke it (the patch only keeps the message). On the H100 the
   exact capture worked and the fp8 one failed ("operation not permitted when stream is capturing").

``--smoke``: the tiny model and a short prompt on the CPU (checks the script; the capture part needs CUDA).
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

import bench_hf as bh
import flashdsa.hf as fh
import flashdsa.hf.v4 as hv


def layer_errors(cfg: dict, prompt: int, device: str) -> list[dict]:
    model = bh.build(cfg, device, torch.float32, "v4")
    ids = torch.randint(1, cfg["vocab_size"], (1, prompt), device=device,
                        generator=torch.Generator(device).manual_seed(1))
    rows = bh.v4_layer_errors(model, ids)
    return [dict(r, **{k: f"{r[k]:.2e}" for k in ("max_err", "mean_err")}) for r in rows]


def capture(indexer: str) -> str:
    """'ok', or the failure with the traceback of the op that broke the capture."""
    cfg = dict(bh.V4_SMOKE, index_head_dim=128)
    model = bh.build(cfg, "cuda", torch.float32 if indexer == "exact" else torch.bfloat16, "v4")
    orig, failure = hv._capture, []

    def traced(run, device):
        try:
            return orig(run, device)
        except Exception:
            failure.append(traceback.format_exc(limit=-14))
            raise
    hv._capture = traced
    try:
        patch = fh.apply(model, indexer=indexer)
        ids = torch.randint(1, cfg["vocab_size"], (2, 40), device="cuda")
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    finally:
        hv._capture = orig
    if patch.graph_failure is None and patch.graph_replays:
        return "ok"
    return f"failed: {patch.graph_failure}\n" + "".join(failure)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=3072)
    ap.add_argument("--smoke", action="store_true", help="tiny model, short prompt, CPU")
    args = ap.parse_args()
    if args.smoke:
        cfg, prompt, device = bh.V4_SMOKE, 40, "cpu"
    elif torch.cuda.is_available():
        cfg, prompt, device = bh.V4, args.prompt, "cuda"
    else:
        sys.exit("v4_hf_check: needs a CUDA device (or --smoke)")
    rows = layer_errors(cfg, prompt, device)
    bh.print_table(rows, f"V4 attention layers vs HF's, fp32, prompt {prompt}, {device}")
    if device == "cuda":
        for indexer in ("exact", "fp8"):
            print(f"[capture] {indexer}: {capture(indexer)}")


if __name__ == "__main__":
    main()

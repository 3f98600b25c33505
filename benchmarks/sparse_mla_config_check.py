"""Every launch configuration of the Triton sparse-MLA kernels against the fp32 reference, on a GPU: which ones
the compiler gets wrong (``triton.miscompiled`` records them; the kernels are right in the interpreter).

    PYTHONPATH=. CUDA_LAUNCH_BLOCKING=1 python benchmarks/sparse_mla_config_check.py [--fmt bf16,fp8]
        [--heads 16,32,64] [--kernels small_h,heads_m,wide]

Per (format, heads, kernel, stages, block_n, slots_ahead): a decode of 2 query rows over top-70 slots (short
lists: any bad tile shows), "BAD" with the max error where it exceeds 0.05 (the rounding bound is ~0.02 here),
"ERR" where it does not launch (shared memory). An illegal memory access poisons the CUDA context: every later
configuration then reports ERR, so the line printed before the first one names the culprit (run the rest
again without it). 2026-12-08, H100, Triton 3.6: small_h at one stage with block_n 64 gave BAD over bf16 rows
and an illegal access over fp8 rows; every other configuration was right.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ops"))
from test_sparse_mla_triton import SM_SCALE, make_cache, make_indices  # noqa: E402

from flashdsa.ops.sparse_mla import reference  # noqa: E402
from flashdsa.ops.sparse_mla import triton as tri  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="bf16,fp8")
    ap.add_argument("--heads", default="16,32,64")
    ap.add_argument("--kernels", default=",".join(tri.KERNELS))
    a = ap.parse_args()
    torch.manual_seed(0)
    for fmt in a.fmt.split(","):
        cache = make_cache(fmt, 2, "cuda")
        for h in [int(x) for x in a.heads.split(",")]:
            q = torch.randn(1, 2, h, 576, device="cuda").to(torch.bfloat16)
            idx = make_indices((1, 2, 70), 2 * 64, "cuda")
            ref, _ = reference.sparse_mla_decode(q, cache, idx, SM_SCALE, 512, None)
            for kernel in a.kernels.split(","):
                for stages in (1, 2, 3):
                    for block_n in (32, 64):
                        for ahead in (False, True):
                            name = f"{fmt} h {h} {kernel} stages {stages} block_n {block_n} ahead {ahead}"
                            print(name, flush=True)
                            cfg = tri.SparseMLAConfig(kernel=kernel, num_stages=stages, block_n=block_n,
                                                      slots_ahead=ahead, num_splits=1)
                            try:
                                # the check itself, not sparse_mla_decode's refusal of a known-bad config
                                out, lse = torch.empty(2, h, 512, dtype=torch.bfloat16, device="cuda"), \
                                    torch.empty(2, h, device="cuda")
                                full = tri.launch_config(h, fmt, 2, 70, q.device, cfg, False)
                                tri._launch(full, q.view(2, h, 576), cache, *cache.stride()[:2], 128, fmt,
                                            idx.view(2, 70), SM_SCALE, 512, None, out, lse)
                                torch.cuda.synchronize()
                            except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                                print(f"{name} ERR {type(e).__name__}", flush=True)
                                continue
                            err = (out.view(1, 2, h, 512).float() - ref.float()).abs().max().item()
                            if err > 0.05:
                                print(f"{name} BAD {err:.3g}", flush=True)
    print("done")


if __name__ == "__main__":
    main()

"""Attention sinks (DeepSeek-V4, gpt-oss): a per-head logit ``sink_h`` in the softmax denominator and not in
the numerator, applied after the attention as one elementwise kernel.

    out' = out * exp(lse) / (exp(lse) + exp(sink)) = out / (1 + exp(sink - lse))

which is the merge of ``(out, lse)`` with an empty partial whose lse is the sink (``merge_attention(out, lse,
0, sink)``, eight torch ops; here one launch: a V4 decode step's sinks took ~20 us of graph replay as the merge).
A row with nothing attended (lse = -inf) stays 0, whatever the sink; sink = -inf leaves the output as it was.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def attention_sinks_kernel(out, lse, sinks, res, H, D, BLOCK_D: tl.constexpr):
    """One program a (row, head): ``res[r, h, :] = out[r, h, :] / (1 + exp(sinks[h] - lse[r, h]))``."""
    i = tl.program_id(0).to(tl.int64)
    lse_i = tl.load(lse + i)
    # an empty row stays 0, with a sink of -inf too (where exp(-inf - -inf) would be NaN)
    f = tl.where(lse_i == float("-inf"), 0.0, 1.0 / (1.0 + tl.exp(tl.load(sinks + i % H) - lse_i)))
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(out + i * D + d, mask=d < D, other=0.0)
        tl.store(res + i * D + d, (x.to(tl.float32) * f).to(res.dtype.element_ty), mask=d < D)


def attention_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The Triton path of :func:`flashdsa.ops.attention_sinks` (arguments checked there, contiguous)."""
    res = torch.empty_like(out)
    H, D = out.shape[-2], out.shape[-1]
    rows = lse.numel()
    if rows:
        attention_sinks_kernel[(rows,)](out, lse, sinks, res, H, D, BLOCK_D=min(512, triton.next_power_of_2(D)),
                                        num_warps=4)
    return res

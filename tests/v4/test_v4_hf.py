"""``flashdsa.hf.apply`` on transformers' DeepSeek-V4, exact mode, against HF eager on the same model.

Default-initialised tiny ``DeepseekV4ForCausalLM`` (a sliding, a CSA and an HCA layer; window 8, CSA rate 4 with
top-4 of its entries, HCA rate 8), prompts of 40-70 tokens (10-17 CSA entries: the indexer selects), 8 greedy
tokens. fp32: the prompt's logits within 1e-3 of their maximum (the issue's bar; the sums differ from HF's
only in order, so the error is fp32 rounding) and the same tokens. bf16: as far from HF's fp32 logits as HF's
own bf16 run is (1.5x), the way tests/test_hf.py bounds bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("transformers without deepseek_v4", allow_module_level=True)
import flashdsa.hf as fh  # noqa: E402

from test_v4_attention import tiny_model  # noqa: E402

PROMPTS = 8


def fp8_model(dtype=torch.bfloat16):
    """The tiny model with the releases' indexer head dim (128: one e4m3 scale a key) for the fp8 mode."""
    return tiny_model(index_head_dim=128).to(dtype)


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (1, int(n)), generator=g) for n in torch.randint(40, 71, (PROMPTS,), generator=g)]


def greedy(model, ids, new=8):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0)


def test_exact_fp32_logits_and_greedy_tokens_equal_hf():
    hf = tiny_model()
    ours = copy.deepcopy(hf)
    patch = fh.apply(ours, indexer="exact")
    for ids in prompts():
        with torch.no_grad():
            want, got = hf(ids).logits, ours(ids).logits
        assert (got - want).abs().max() <= 1e-3 * want.abs().max()
        assert torch.equal(greedy(ours, ids), greedy(hf, ids))
    assert patch.calls[0] > 0 and fh.get_patch(ours) is patch


def test_exact_bf16_as_close_to_hf_fp32_as_hf_bf16():
    hf32 = tiny_model()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    ours = copy.deepcopy(hf16)
    fh.apply(ours, indexer="exact")
    for ids in prompts()[:4]:
        with torch.no_grad():
            ref = hf32(ids).logits.double()
            theirs = (hf16(ids).logits.double() - ref).norm()
            mine = (ours(ids).logits.double() - ref).norm()
        assert mine <= 1.5 * theirs, (float(mine), float(theirs))


def test_batches_decode_and_what_is_refused():
    hf = tiny_model()
    ours = copy.deepcopy(hf)
    ids = torch.randint(0, 128, (3, 45), generator=torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match="^indexer"):
        fh.apply(ours, indexer="fp4")
    with pytest.raises(ValueError, match="^kv_format"):
        fh.apply(ours, kv_format="fp8")
    with pytest.raises(NotImplementedError, match="^record"):
        fh.apply(ours, record=True)
    with pytest.raises(ValueError, match="^cuda_graphs"):
        fh.apply(ours, cuda_graphs=1)
    fh.apply(ours, indexer="exact")
    assert torch.equal(greedy(ours, ids), greedy(hf, ids))  # a batch of equal-length rows
    mask = torch.ones_like(ids)
    mask[0, 5:9] = 0  # a hole, not left padding
    with pytest.raises(NotImplementedError, match="attention_mask"):
        with torch.no_grad():
            ours(ids, attention_mask=mask)
    fh.unapply(ours)
    assert fh.get_patch(ours) is None
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, hf(ids).logits)  # HF's attention again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_padded_batches_equal_hf(dtype):
    """A batch of prompts of 40-70 tokens left-padded to the longest (what generate() makes of them): HF's V4
    pools the padding tokens into its entries, masks them out of every window and gives each row its own
    position ids; exact mode does the same. fp32: the logits at every position (padding included: those
    queries see nothing but the sinks) within 1e-3 of their maximum, and the same 8 greedy tokens; bf16: the
    same tokens as HF bf16 is not promised (bf16 rounding), the logits as far from HF fp32's as HF bf16's (1.5x)."""
    hf32 = tiny_model()
    hf = copy.deepcopy(hf32).to(dtype)
    ours = copy.deepcopy(hf)
    fh.apply(ours, indexer="exact")
    g = torch.Generator().manual_seed(14)
    lens = [40, 52, 70, 61]
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lens):
        ids[b, -n:] = torch.randint(1, 128, (n,), generator=g)
        mask[b, -n:] = 1
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # generate()'s position ids
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=pos).logits.double()
        got = ours(ids, attention_mask=mask, position_ids=pos).logits.double()
        ref = hf32(ids, attention_mask=mask, position_ids=pos).logits.double()
    if dtype == torch.float32:
        assert (got - want).abs().max() <= 1e-3 * want.abs().max()
        out = ours.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                            pad_token_id=0)
        assert torch.equal(out, hf.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                                            do_sample=False, pad_token_id=0))
    else:
        assert (got - ref).norm() <= 1.5 * (want - ref).norm()


def test_fp8_mode_close_to_exact_not_equal():
    """indexer="fp8": the window rows and entries stored once as fp8 MLA rows and read by the paged decode
    kernels, the indexer's keys and queries e4m3; on the bf16 model its next-token argmaxes agree with the exact
    mode's on >= 90 % of the prompt positions (#43's bar), its logits close but not equal. Measured on
    2026-12-04: 93.8 % (92.5 % against HF's fp32 eager), logits at most 8.6 % apart norm-wise."""
    exact = fp8_model()
    fast = copy.deepcopy(exact)
    fh.apply(exact, indexer="exact")
    patch = fh.apply(fast, indexer="fp8")
    agree = total = 0
    for ids in prompts():
        with torch.no_grad():
            a, b = exact(ids).logits.float(), fast(ids).logits.float()
        assert not torch.equal(a, b) and (a - b).norm() / a.norm() < 0.2
        agree, total = agree + int((a.argmax(-1) == b.argmax(-1)).sum()), total + a.shape[1]
    assert agree / total >= 0.9, agree / total
    out = greedy(fast, prompts()[0])
    assert out.shape[1] == prompts()[0].shape[1] + 8 and patch.calls[1] > 0
    state = fast.model.layers[1].self_attn  # the layer's rows really are fp8
    assert patch.steps[1].precision == "fp8" and state.layer_type == "compressed_sparse_attention"


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("indexer", ["exact", "fp8"])
def test_decode_from_cuda_graphs(indexer):
    """generate() with decode from CUDA graphs (the default on CUDA) gives the tokens of the eager patched model
    (exact fp32: HF's too) over 12 greedy steps of a batch of 2; a second generate() takes over the first cache's
    buffers and replays the same graph (no new capture); logits of a graphed step within the attention's
    rounding of the eager one (another list layout: more -1 slots, another summation order)."""
    dtype = torch.float32 if indexer == "exact" else torch.bfloat16
    model = (tiny_model() if indexer == "exact" else fp8_model()).to("cuda", dtype)
    hf = copy.deepcopy(model)
    eager, graphed = copy.deepcopy(model), copy.deepcopy(model)
    fh.apply(eager, indexer=indexer, cuda_graphs=False)
    patch = fh.apply(graphed, indexer=indexer)
    g = torch.Generator("cuda").manual_seed(13)
    ids = torch.randint(0, 128, (2, 45), device="cuda", generator=g)
    want = greedy(eager, ids, new=12)
    got = greedy(graphed, ids, new=12)
    assert patch.graph_failure is None, patch.graph_failure
    assert patch.graph_replays == 11 and len(patch.graphs) == 1
    assert torch.equal(got, want)
    if indexer == "exact":
        assert torch.equal(got, greedy(hf, ids, new=12))
    again = torch.randint(0, 128, (2, 50), device="cuda", generator=g)
    assert torch.equal(greedy(graphed, again, new=6), greedy(eager, again, new=6))
    assert patch.graph_replays == 16 and len(patch.graphs) == 1
    with torch.no_grad():  # one graphed step's logits against the eager step's
        a = eager(again, use_cache=True)
        b = graphed(again, use_cache=True)
        nxt = a.logits[:, -1:].argmax(-1)
        la = eager(nxt, past_key_values=getattr(a, "past_key_values", None) or a.cache).logits
        lb = graphed(nxt, past_key_values=getattr(b, "past_key_values", None) or b.cache).logits
    assert patch.graph_replays == 17
    tol = 1e-4 if indexer == "exact" else 2e-2
    assert (la - lb).abs().max() <= tol * la.abs().max()
    padded = again.clone()
    mask = torch.ones_like(padded)
    mask[0, :9] = 0  # row 0 left-padded: its positions run 9 behind its token indices
    padded[0, :9] = 0

    def run(m):
        return m.generate(padded, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                          pad_token_id=0)
    assert torch.equal(run(graphed), run(eager))
    assert patch.graph_replays == 22 and patch.graph_failure is None


def test_graph_bookkeeping_on_cpu(monkeypatch):
    """The graph path's host side, on the CPU: ``_capture`` replaced by a stand-in whose "replay" runs the captured
    call again (the decoder's forward with the capturable decode step, from the static buffers), so everything
    but CUDA's capture runs — the gate, the reservation, the static token / position buffers, the host advancing
    the states and HF's cache lengths, a new cache taking over a gone one's buffers. fp32 exact: the tokens of
    the eager patch and of HF, unpadded and left-padded; one "capture" a batch shape, every later step a replay."""
    import flashdsa.hf.v4 as hv
    captures = []

    def fake_capture(run, device):
        out = run()  # the warm-up's write of this position's slots (retry-safe: the replay writes them again)
        captures.append(device)
        hidden = out["last_hidden_state"]  # not `out`: it holds the cache

        class Replay:
            def replay(self):
                hidden.copy_(run()["last_hidden_state"])
        return Replay(), out
    monkeypatch.setattr(hv, "_capture", fake_capture)
    monkeypatch.setattr(hv, "_graphs_possible", lambda device: True)
    hf = tiny_model(index_n_heads=8)  # few exact-0 ties: the capturable top-k runs over the reserved row on CPU
    eager, graphed = copy.deepcopy(hf), copy.deepcopy(hf)
    fh.apply(eager, indexer="exact", cuda_graphs=False)
    patch = fh.apply(graphed, indexer="exact")
    g = torch.Generator().manual_seed(15)
    ids = torch.randint(1, 128, (2, 45), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0

    def run(model, m):
        return model.generate(ids, attention_mask=m, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=0)
    for m in (torch.ones_like(ids), mask):
        want = run(hf, m)
        assert torch.equal(run(eager, m), want)
        assert torch.equal(run(graphed, m), want)
    assert patch.graph_failure is None and len(captures) == 1 and patch.graph_replays == 14
    assert list(patch.graphs) == [(2, 1024)]


def test_graph_capture_failure_warns_once_and_decodes_eagerly(monkeypatch):
    """A decode step that cannot be captured (the stand-in ``_capture`` raises, as a host read under capture
    does): one RuntimeWarning naming the cause, ``graph_failure`` set, every later step eager with HF's tokens,
    and the failed warm-up not counted as forwards."""
    import flashdsa.hf.v4 as hv

    def broken(run, device):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(hv, "_capture", broken)
    monkeypatch.setattr(hv, "_graphs_possible", lambda device: True)
    hf = tiny_model()
    ours = copy.deepcopy(hf)
    patch = fh.apply(ours, indexer="exact")
    ids = prompts()[0]
    with pytest.warns(RuntimeWarning, match="capturing the DeepSeek-V4 decode step .*not permitted") as seen:
        got = greedy(ours, ids)
    assert len([w for w in seen if "CUDA graph" in str(w.message)]) == 1
    assert torch.equal(got, greedy(hf, ids))
    assert "not permitted" in patch.graph_failure and not patch.graphs and patch.graph_replays == 0
    assert patch.calls == [8] * len(patch.calls)  # a prompt forward and 7 eager decode steps a layer


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_prompts_shorter_than_a_compressed_window_equal_hf():
    """Prompts of 1, 3 and 6 tokens: shorter than HCA's rate 8 (and 1, 3 than CSA's 4), so a prefill closes no
    entry (a V4 release's HCA rate is 128: every prompt under 128 tokens). HF's fp32 logits and greedy tokens."""
    hf = tiny_model()
    ours = copy.deepcopy(hf)
    fh.apply(ours, indexer="exact")
    g = torch.Generator().manual_seed(5)
    for n in (1, 3, 6):
        ids = torch.randint(1, 128, (2, n), generator=g)
        with torch.no_grad():
            want, got = hf(ids).logits, ours(ids).logits
        assert (got - want).abs().max() <= 1e-3 * want.abs().max(), n
        assert torch.equal(greedy(ours, ids), greedy(hf, ids)), n

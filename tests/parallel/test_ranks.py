"""Context parallelism on 2 and 3 gloo processes (CPU) against one process (scenarios.py: several requests,
uneven lengths, one shorter than 2p, chunked prefill, decode, MTP verify).

Every layer of the parallel run is fed one process's input for that layer (flashdsa.parallel.check), so
each layer is compared on equal inputs: the selection must be bitwise one process's, the attention output
within the derived bound (prefill CP: equal; it changes no arithmetic of any row). Failures: a rank that
cannot prepare a batch, raises mid-forward or stalls stops every rank with a clear error, never a hang.
"""

from __future__ import annotations

import math

import pytest
import torch

import scenarios as S
from flashdsa import plan as cost
from flashdsa.parallel import check
from ranks import run_ranks

CASES = {2: [("cp", "interleave", "fp8"), ("cp", "zigzag", "exact"), ("dcp", 1, "fp8"), ("cp", "zigzag", "kpool")],
         3: [("cp", "zigzag", "fp8"), ("cp", "interleave", "fp8"), ("dcp", 2, "exact"), ("cp", "interleave", "kpool")]}
PRECISIONS = ("fp8", "exact", "kpool")  # "kpool": fp8 keys pooled 4 to 1 (scenarios.model)
ALL = [(world, case) for world, cases in CASES.items() for case in cases]
IDS = [f"p{w}-{m}-{a}-{p}" for w, (m, a, p) in ALL]


@pytest.fixture(scope="module")
def refs():
    return {precision: S.reference(precision) for precision in PRECISIONS}


@pytest.fixture(scope="module")
def runs(refs):
    force = {p: check.inputs_only(r["trace"]) for p, r in refs.items()}
    out = {}
    for world, cases in CASES.items():
        results = run_ranks(S.on_rank, world, cases, force, world == 2)
        for rank, r in enumerate(results):
            assert "ok" in r, f"rank {rank} of {world} failed:\n{r.get('traceback')}"
        out[world] = [r["ok"] for r in results]
    return out


@pytest.mark.parametrize("world, case", ALL, ids=IDS)
def test_every_layer_selects_bitwise_and_attends_within_the_bound(refs, runs, world, case):
    mode, _, precision = case
    ref = refs[precision]
    for rank, res in enumerate(runs[world]):
        got = check.compare(ref["trace"], res[case]["trace"], ref["max_v"], S.CFG.index_topk)
        assert got["layers"] == len(S.STEPS) * S.CFG.num_hidden_layers
        assert got["selections_equal"], f"rank {rank}: rows whose selection differs: {got['mismatches']}"
        if mode == "cp":  # the same arithmetic per row, on the same inputs
            assert got["max_abs"] == 0.0, f"rank {rank}: {got}"
        else:
            assert got["worst_over_tolerance"] <= 1.0, f"rank {rank}: {got}"


@pytest.mark.parametrize("world, case", ALL, ids=IDS)
def test_every_rank_ends_with_the_same_logits_and_prefill_cp_with_one_process_s(refs, runs, world, case):
    ranks = [res[case]["logits"] for res in runs[world]]
    for other in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0], other))
    if case[0] == "cp":  # fed equal inputs and computing equal outputs, the residual stream is equal too
        assert all(torch.equal(a, b) for a, b in zip(ranks[0], refs[case[2]]["logits"]))
    assert all(res[case]["skip_reuses"] for res in runs[world])  # layer 2 reuses layer 1's (localised) slots


@pytest.mark.parametrize("world, case", ALL, ids=IDS)
def test_bytes_per_rank_per_layer_are_the_plan_s(runs, world, case):
    mode, _, precision = case
    cfg = S.CFG
    for res in runs[world]:
        traffic = res[case]["traffic"]
        if mode == "cp":
            t = sum(len(c) for c in S.STEPS[0][1].values())
            want = cost.cp_gather_bytes_per_rank_per_layer(cfg, t, world)
            rows = (world - 1) * math.ceil(t / world)
            # bf16 key (exact), bf16 key and pooling gate (kpool: pooled after the gather), else fp8 + scale
            key = {"exact": rows * 2 * cfg.index_head_dim, "kpool": rows * 4 * cfg.index_head_dim}.get(
                precision, want["indexer"])
            first = traffic[0]
            assert first["mla"] == [want["mla"]] * cfg.num_hidden_layers
            assert first["indexer"] == [key] * len(cfg.topk_layers)
            assert traffic[3] is None  # decode runs replicated under prefill CP: nothing moves
        else:
            decode = next(i for i, (m, _) in enumerate(S.STEPS) if m == "decode")
            want = cost.dcp_bytes_per_rank_per_layer(cfg, len(S.STEPS[decode][1]), world)
            assert traffic[decode]["topk_candidates"] == [want["topk_candidates"]] * len(cfg.topk_layers)
            assert traffic[decode]["partial_attention"] == [want["partial_attention"]] * cfg.num_hidden_layers


def test_ranks_that_cannot_all_prepare_a_batch_all_refuse_and_keep_their_state(runs):
    r0, r1 = (res["refuse"] for res in runs[2])
    for r in (r0, r1):
        assert "the ranks were given different batches" in r["different"] and r["different_state_kept"]
        assert r["out_of_pages_state_kept"]
    assert torch.equal(r0["after"], r1["after"]) and torch.equal(r0["after_dcp"], r1["after_dcp"])
    assert r0["out_of_pages"].startswith("OutOfPagesError")  # rank 0 holds 65 of the 129 tokens: 2 pages
    assert r1["out_of_pages"].startswith("ValueError: new_tokens: rank 0 of 2 could not prepare this batch")


def test_a_rank_that_fails_mid_forward_stops_every_rank():
    results = run_ranks(S.fail_mid_forward, 2)
    assert results[1].get("error") == "RuntimeError: injected failure on rank 1 in layer 1"
    assert results[0].get("type") == "ParallelError", results[0]
    assert results[0]["error"].startswith("ParallelError: rank 0 of 2: the all-gather of the cache rows")


def test_a_rank_that_stalls_runs_the_others_into_the_group_timeout():
    timeout = 3.0
    results = run_ranks(S.stall, 2, timeout)
    assert results[1] == {"ok": "stalled"}
    assert results[0].get("type") == "ParallelError", results[0]
    assert f"within the {timeout:g} s timeout" in results[0]["error"]

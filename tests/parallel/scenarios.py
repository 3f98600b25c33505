"""The batches the parallel tests run, on one process (the reference) and on every rank.

Several requests of uneven lengths, one shorter than 2p and two of a single token (one alone in its
batch), a prompt longer than top-k (64 in the tiny preset) so the sparse path selects, a second extend on
top of a cached prefix (chunked prefill), a decode step and an MTP verify step with 2 drafts.
"""

from __future__ import annotations

import torch

from flashdsa import DSAConfig
from flashdsa.engine import DSAModel, Runner
from flashdsa.parallel import check
from flashdsa.testing.inputs import token_ids

CFG = DSAConfig.preset("tiny")  # topk 64; layer 2 skips top-k
PAGES = 24


def prompt(n: int, seed: int) -> torch.Tensor:
    return token_ids(n, CFG.vocab_size, seed)


_P = {"a": prompt(90, 1), "b": prompt(37, 2), "c": prompt(5, 3), "d": prompt(1, 4), "e": prompt(1, 5)}
STEPS = [
    ("extend", {"a": _P["a"][:70], "b": _P["b"], "c": _P["c"][:2], "d": _P["d"]}),
    ("extend", {"a": _P["a"][70:], "c": _P["c"][2:]}),
    ("extend", {"e": _P["e"]}),  # one token: every rank but one computes no row at all
    ("decode", {r: torch.tensor([7 + i]) for i, r in enumerate(_P)}),
    ("target_verify", {r: torch.tensor([3 + i, 40 + i]) for i, r in enumerate(_P)}),
]


KPOOL = 4  # the "kpool" case: fp8 indexer keys pooled 4 to 1 (top-64 = 16 groups), pages of 256 tokens


def model(precision: str = "fp8") -> DSAModel:
    """The tiny model with indexer ``precision`` "fp8" or "exact", or "kpool": fp8 keys pooled KPOOL to 1."""
    if precision == "kpool":
        return DSAModel.random(CFG.replace(index_kpool=KPOOL), seed=0)
    m = DSAModel.random(CFG, seed=0)
    for layer in m.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.precision = precision
    return m


@torch.no_grad()
def drive(runner: Runner, steps=STEPS) -> tuple[list[torch.Tensor], list[dict]]:
    """Run the steps; the logits of each and the bytes the rank received (``plan.traffic``) in each."""
    logits, traffic = [], []
    for mode, chunks in steps:
        meta, _ = runner.prepare({r: len(t) for r, t in chunks.items()}, mode, force_sparse=True)
        logits.append(runner.forward(torch.cat(list(chunks.values())), meta))
        traffic.append(None if meta.parallel is None else meta.parallel.traffic)
    return logits, traffic


def reference(precision: str = "fp8", steps=STEPS) -> dict:
    """One process: logits, the layer trace, and max |V| per layer for the output bound."""
    m = model(precision)
    run = Runner(m, PAGES, "fp8", backend="torch")
    with check.trace(m) as records:
        logits, _ = drive(run, steps)
    return {"logits": logits, "trace": records, "max_v": check.max_values(run.pool, list(steps[-1][1]))}


def on_rank(comm, cases: list[tuple[str, object, str]], force: dict, refuse: bool = False, steps=STEPS) -> dict:
    """On one rank, for each case (mode "cp" / "dcp", split / block, indexer precision): the run with every
    layer fed one process's input (``force[precision]``, see :func:`flashdsa.parallel.check.trace`): its
    logits, layer trace and traffic, and whether skip-top-k layers reused the previous layer's selection;
    with ``refuse``, then :func:`refuse_together` (sharing the processes saves a start-up)."""
    from flashdsa.parallel import ContextParallel, DecodeContextParallel

    out = {}
    for mode, arg, precision in cases:
        m = model(precision)
        par = ContextParallel(comm, arg) if mode == "cp" else DecodeContextParallel(comm, arg)
        run = Runner(m, PAGES, "fp8", backend="torch", parallel=par, record=True)
        with check.trace(m, force[precision]) as records:
            logits, traffic = drive(run, steps)
        out[(mode, arg, precision)] = {
            "trace": records, "logits": logits, "traffic": traffic,
            "skip_reuses": all(run.selections[l] is run.selections[l - 1] for l in CFG.skip_topk_layers)}
    if refuse:
        out["refuse"] = refuse_together(comm)
    return out


# ---- failures --------------------------------------------------------------------------------------

def refuse_together(comm) -> dict:
    """Batches that only some ranks can prepare: every rank must refuse and keep its state, and the group
    must still work afterwards."""
    from flashdsa.parallel import ContextParallel, DecodeContextParallel

    out = {}
    m = model()
    run = Runner(m, PAGES, "fp8", backend="torch", parallel=ContextParallel(comm, "interleave"))
    free = run.alloc.num_free_pages
    try:  # rank 1 is given a different batch
        run.extend({"a": prompt(20 + comm.rank, 1)})
    except ValueError as e:
        out["different"] = str(e)
    out["different_state_kept"] = "a" not in run.alloc and run.alloc.num_free_pages == free
    out["after"] = run.extend({"a": prompt(20, 1)})  # the group and the runner still work
    # DCP, one page per rank: 129 tokens put 65 on rank 0 (2 pages) and 64 on rank 1 (1 page)
    dcp = Runner(m, 1, "fp8", backend="torch", parallel=DecodeContextParallel(comm, 1))
    try:
        dcp.extend({"x": prompt(129, 5)})
    except Exception as e:  # noqa: BLE001
        out["out_of_pages"] = f"{type(e).__name__}: {e}"
    out["out_of_pages_state_kept"] = "x" not in dcp.alloc and dcp.alloc.local.num_free_pages == 1
    out["after_dcp"] = dcp.extend({"x": prompt(100, 5)})
    return out


def fail_mid_forward(comm) -> str:
    """Rank 1 raises in layer 1's exchange, after layer 0's all-gather went through."""
    from flashdsa.parallel import ContextParallel, PrefillPlan

    if comm.rank == 1:
        calls = []
        exchange = PrefillPlan.exchange

        def failing(self, kv_rows, idx):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure on rank 1 in layer 1")
            return exchange(self, kv_rows, idx)
        PrefillPlan.exchange = failing
    run = Runner(model(), PAGES, "fp8", backend="torch", parallel=ContextParallel(comm, "zigzag"))
    run.extend({"a": prompt(30, 1)})
    return "finished"


def stall(comm, timeout_s: float) -> str:
    """Rank 1 stays away (alive, not crashed) for 3 timeouts; rank 0 runs a batch over a group whose
    timeout is ``timeout_s`` (made after both ranks joined, so a slow start cannot trip it)."""
    import datetime
    import time

    import torch.distributed as dist

    from flashdsa.parallel import Comm, ContextParallel

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s))
    if comm.rank == 1:
        time.sleep(3 * timeout_s)
        return "stalled"
    short = Comm(comm.device, group, timeout_s)
    run = Runner(model(), PAGES, "fp8", backend="torch", parallel=ContextParallel(short, "zigzag"))
    run.extend({"a": prompt(9, 1)})
    return "finished"

"""The batches the parallel tests run, on one process (the reference) and on every rank.

Several requests of uneven lengths, one shorter than 2p and one of a single token, a prompt longer than
top-k (64 in the tiny preset) so the sparse path selects, a second extend on top of a cached prefix
(chunked prefill), two decode steps and an MTP verify step with 2 drafts.
"""

from __future__ import annotations

import torch

from flashdsa import DSAConfig
from flashdsa.engine import DSAModel, Runner
from flashdsa.parallel import check

CFG = DSAConfig.preset("tiny")  # topk 64; layer 2 skips top-k
PAGES = 24


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


_P = {"a": prompt(90, 1), "b": prompt(37, 2), "c": prompt(5, 3), "d": prompt(1, 4)}
STEPS = [
    ("extend", {"a": _P["a"][:70], "b": _P["b"], "c": _P["c"][:2], "d": _P["d"]}),
    ("extend", {"a": _P["a"][70:], "c": _P["c"][2:]}),
    ("decode", {r: torch.tensor([7 + i]) for i, r in enumerate(_P)}),
    ("target_verify", {r: torch.tensor([3 + i, 40 + i]) for i, r in enumerate(_P)}),
]


def model() -> DSAModel:
    return DSAModel.random(CFG, seed=0)


@torch.no_grad()
def drive(runner: Runner, steps=STEPS) -> tuple[list[torch.Tensor], list[dict]]:
    """Run the steps; the logits of each and the bytes the rank received (``plan.traffic``) in each."""
    logits, traffic = [], []
    for mode, chunks in steps:
        meta, _ = runner.prepare({r: len(t) for r, t in chunks.items()}, mode, force_sparse=True)
        logits.append(runner.forward(torch.cat(list(chunks.values())), meta))
        traffic.append(None if meta.parallel is None else meta.parallel.traffic)
    return logits, traffic


def reference(kv_format: str = "fp8", steps=STEPS) -> dict:
    """One process: logits, the layer trace, and max |V| per layer for the output bound."""
    m = model()
    run = Runner(m, PAGES, kv_format, backend="torch")
    with check.trace(m) as records:
        logits, _ = drive(run, steps)
    return {"logits": logits, "trace": records, "max_v": check.max_values(run.pool, list(steps[0][1]))}


def on_rank(comm, cases: list[tuple[str, object]], kv_format: str, force, steps=STEPS) -> dict:
    """On one rank, for each case ("cp", split) or ("dcp", block): the run with every layer fed one process's
    input (:func:`flashdsa.parallel.check.trace`), its logits, layer trace and traffic, and whether the
    skip-top-k layers reused the previous layer's selection object."""
    from flashdsa.parallel import ContextParallel, DecodeContextParallel

    m, out = model(), {}
    for mode, arg in cases:
        par = ContextParallel(comm, arg) if mode == "cp" else DecodeContextParallel(comm, arg)
        run = Runner(m, PAGES, kv_format, backend="torch", parallel=par, record=True)
        with check.trace(m, force) as records:
            logits, traffic = drive(run, steps)
        out[(mode, arg)] = {"trace": records, "logits": logits, "traffic": traffic,
                            "skip_reuses": all(run.selections[l] is run.selections[l - 1] for l in CFG.skip_topk_layers)}
    return out

#!/usr/bin/env bash
# One run on a GPU box: peer wheels from .anchors/ (if any), then the named stages; logs and JSON
# under $OUT (default ./out).
#   bash benchmarks/gpu_session.sh tests indexer topk sparse_mla demo hf
# Stages: tests (every GPU test, `-m gpu`: compiled kernels vs the references, 9.7 min on 2026-12-02, close to a
# 10-min command limit; tests-ops / tests-rest:
# tests/ops (about 8 min on 2026-12-02: a 400-s timeout cut it at ~85 %; tests-ops1 / tests-ops2 split it by name,
# a-i / j-z) / everything else (about 3 min), for runs of a few minutes), <op> (benchmarks/bench_<op>.py),
# demo (flashdsa demo on v32, few layers), hf (benchmarks/bench_hf.py), gluon (the Gluon sparse-MLA probes:
# the shipped fp8 decode and bf16 prefill / decode kernels checked against the reference and timed next to
# FlashMLA, and the bf16 kernel's fixed cost per CTA; about 4 min), ncu (Nsight
# Compute sections of our Gluon sparse-MLA kernels and FlashMLA's, decode and prefill: $OUT/ncu*.txt; and our
# kernels' per-SASS-instruction counters, summarised by benchmarks/ncu_sass_top.py: $OUT/ncu-sass*.txt),
# gluon-indexer (the Gluon paged indexer checked and timed next to the Triton kernel and DeepGEMM; under a
# minute), grid (benchmarks/sparse_decode_grid.py: sparse decode over batch x heads), v4 (DeepSeek-V4 through
# flashdsa.hf: GPU tests, benchmarks/v4_hf_check.py, bench_hf --arch v4), selection / layer / host (`flashdsa bench
# --ops <stage>`: decode selection against DeepGEMM -> fast_topk_transform_fused, the decode step per stage, the
# host cost of plain calls; SGL_LIBS=.anchors/sglk by default when that folder exists).
# BENCH_ARGS go to every bench.
# Wheels in .anchors/ are installed over the image's packages: put a transformers >= 5.23 wheel there for
# the hf stage and test_hf (the H200 image had 5.17 on 2026-12-01): 5.23.0 needs huggingface_hub >= 1.31 (the
# image's 1.33 does; 5.25 needs hub >= 2.4, which pulls httpx2 and hf-xet) and regex >= 2025.10.22 (add a cp312 regex
# wheel): `pip download --no-deps transformers==5.23.0` and `pip download --no-deps --python-version 3.12
# --only-binary=:all: regex` into .anchors/.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .anchors/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --target .peers .anchors/*.whl
fi
[ -d .anchors/sglk ] && SGL_LIBS=${SGL_LIBS:-.anchors/sglk}
export PYTHONPATH=$PWD/.peers:$PWD PYTHONUNBUFFERED=1 FLASHDSA_CHECK_VALUES=${FLASHDSA_CHECK_VALUES:-1}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for stage in "$@"; do
  echo "=== stage $stage $(date +%T)"
  case $stage in
    tests) timeout 590 python3 -m pytest -q -p no:cacheprovider -m gpu tests -rf 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    tests-ops) timeout 590 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops -rf 2>&1 | tee "$OUT/tests-ops.log" | tail -25 ;;
    tests-ops1) timeout 590 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_[a-i]*.py -rf 2>&1 \
                  | tee "$OUT/tests-ops1.log" | tail -25 ;;
    tests-ops2) timeout 590 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_[j-z]*.py -rf 2>&1 \
                  | tee "$OUT/tests-ops2.log" | tail -25 ;;
    tests-rest) timeout 590 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/ops -rf 2>&1 \
                  | tee "$OUT/tests-rest.log" | tail -25 ;;
    demo)  timeout 300 python3 -m flashdsa.cli demo --preset v32 --device cuda --layers ${DEMO_LAYERS:-4} --json 2>&1 | tee "$OUT/demo.json" | tail -3 ;;
    hf)    timeout 300 python3 benchmarks/bench_hf.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_hf.log" | tail -30 ;;
    gluon) timeout 200 python3 benchmarks/gluon_sparse_mla_probe.py --child-timeout 150 2>&1 | tee "$OUT/gluon_fp8.log" | tail -8
           timeout 200 python3 benchmarks/gluon_prefill_probe.py --child-timeout 60 2>&1 | tee "$OUT/gluon_bf16.log" | tail -22
           timeout 100 python3 benchmarks/gluon_prefill_fixed.py 2>&1 | tee "$OUT/gluon_fixed.log" | tail -6 ;;
    selection|layer|host)   # flashdsa bench's op of that name (peers from .anchors/sglk when present)
           timeout 300 python3 -m flashdsa.cli bench --ops $stage ${SGL_LIBS:+--peer-libs $SGL_LIBS} \
             --json "$OUT/bench_$stage.json" 2>&1 | grep -v "case/s" | tee "$OUT/bench_$stage.log" | tail -30 ;;
    gluon-indexer)
           timeout 280 python3 benchmarks/gluon_indexer_probe.py 2>&1 | tee "$OUT/gluon_indexer.log" | tail -22 ;;
    grid)  timeout 400 python3 benchmarks/sparse_decode_grid.py 2>&1 | tee "$OUT/sparse_decode_grid.log" | tail -20 ;;
    v4)    # DeepSeek-V4 through flashdsa.hf (needs the transformers wheel in .anchors/): the GPU tests, where it
           # leaves HF's numbers and whether its decode captures, then generate() against HF eager
           timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/v4 -rf 2>&1 | tee "$OUT/tests-v4.log" | tail -8
           timeout 200 python3 benchmarks/v4_hf_check.py 2>&1 | tee "$OUT/v4_hf_check.log" | tail -30
           timeout 200 python3 benchmarks/bench_hf.py --arch v4 --quick ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_hf_v4.log" | tail -10 ;;
    ncu)   for mode in "" --prefill; do
             timeout 150 ncu --kernel-name regex:'ws_kernel|mla|sparse' --launch-count 12 --section SpeedOfLight \
               --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
               --section WarpStateStats --section SchedulerStats python3 benchmarks/ncu_sparse_mla.py --calls 1 $mode \
               > "$OUT/ncu${mode:+-prefill}.txt" 2>&1; tail -3 "$OUT/ncu${mode:+-prefill}.txt"
             # per-SASS-instruction counters of our kernel (bank conflicts, spills, stall samples), summarised
             timeout 150 ncu --kernel-name regex:'ws_kernel' --launch-count 1 --section SourceCounters --page source \
               --print-source sass --csv python3 benchmarks/ncu_sparse_mla.py --calls 1 $mode \
               > "$OUT/ncu-sass${mode:+-prefill}.csv" 2>&1
             python3 benchmarks/ncu_sass_top.py "$OUT/ncu-sass${mode:+-prefill}.csv" | tee "$OUT/ncu-sass${mode:+-prefill}.txt" \
               | head -4
           done ;;
    *)     timeout ${STAGE_TIMEOUT:-300} python3 benchmarks/bench_$stage.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$stage.log" | tail -40 ;;
  esac
done

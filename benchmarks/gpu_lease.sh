#!/usr/bin/env bash
# Everything a lent GPU machine should check, in one call: versions, the CUDA- and Triton-marked tests on the
# device (no interpreter), then the GPU benchmarks. $OUT (default /tmp/dynemb-gpu) gets 14 files, what a device
# call brings back: summary.txt (versions, each part's status), tests.txt, junit.xml, bench.txt (every benchmark's
# output) and a JSON file a benchmark; the last lines printed are a short summary. Run from the repository root,
# with the image's python3 (torch, triton, numba, pytest-xdist, pytest-timeout, hypothesis; no install needed, the
# package is read from src/):
#
#   bash benchmarks/gpu_lease.sh [test_seconds] [ranks_seconds] [pytest -k expression] [grouped_seconds] \
#     [tiered_seconds] [engine_seconds]
#
# Slots, in this order, each under its own limit (defaults: 90 + 150 + 60 + 150 s, about 8 minutes with the
# machine's start, leaving 4 of a 15-minute lease for a rerun):
# - tests (test_seconds, 90): the cuda- and triton-marked tests on the device (serving, issue 46: a CLI run and a
#   model exported from CUDA, served on the GPU).
# - grouped execution (issue 43; grouped_seconds, 150): the collection's reads, ops and launches a steady step at 2
#   and 26 tables (step_counts.py), the main job's step at batch 512 and 32,768 with 0% and 5% new ids (job_step.py;
#   targets <= 3 ms and <= 15 ms), three runs of the gpu_ops.py train step (targets >= 1.0x nn.EmbeddingBag +
#   Adagrad, >= 0.9x static tables on dynemb's Triton kernels: the "vs static" column).
# - training across ranks (issue 45; ranks_seconds, 60): the world-1 NCCL step with a background save during
#   training, then the pipelined step against the plain loop.
# - tiered tables (issue 47; tiered_seconds, 150, 0 skips it): 4 tables x 25M rows x dim 64, 10% in device memory
#   over pinned host memory, zipf 1.05, 65,536 ids a table a step; steps/s against all in device memory, bytes
#   moved / move time against pinned H2D bandwidth.
# - engine figures (engine_seconds, 0 by default: no open issue's target): gpu_ops index, job_step CPU against
#   CUDA, table_ops.
#
# The serving stores (redis, RocksDB, LMDB) are not exercised: their tests are CPU-only and need packages a GPU
# image may lack; collection errors from such modules do not stop the run.
set -u
OUT=${OUT:-/tmp/dynemb-gpu}
mkdir -p "$OUT"
TEST_S=${1:-90}
RANKS_S=${2:-60}
KEXPR=${3:-}
GROUPED_S=${4:-150}
TIERED_S=${5:-150}
ENGINE_S=${6:-0}
PY=${PY:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
unset TRITON_INTERPRET
start=$(date +%s)

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import sys, torch, triton, numba; p = torch.cuda.get_device_properties(0); print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numba', numba.__version__); print(p.name, p.multi_processor_count, 'SMs', p.total_memory >> 30, 'GiB')"
  lscpu | grep -m1 'Model name'
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"

tests=(tests/kernels tests/table tests/test_embedding.py tests/collection tests/job/test_score.py
       tests/test_row_grouping.py tests/test_functional.py tests/endpoint/test_served_cuda.py)
opts=()  # workers and a per-test limit (well inside the run's, so that a hung test still leaves a report)
$PY -c "import xdist" 2>/dev/null && opts+=(-n 8)
$PY -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout "$(( TEST_S / 2 > 30 ? TEST_S / 2 : 30 ))")
timeout -k 10 "$TEST_S" $PY -m pytest -p no:cacheprovider -q -o addopts="" "${opts[@]}" --tb=short \
  --continue-on-collection-errors --maxfail=40 -m "cuda or triton" ${KEXPR:+-k "$KEXPR"} \
  --junitxml "$OUT/junit.xml" "${tests[@]}" > "$OUT/tests.txt" 2>&1
tests_rc=$?
echo "tests rc $tests_rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/tests.txt" >> "$OUT/summary.txt"

bench() {  # name seconds command...: skipped when under 5 s are left (timeout 0 would mean no limit)
  local name=$1 secs=$2; shift 2
  if (( secs < 5 )); then echo "$name skipped: no time left" >> "$OUT/summary.txt"; return; fi
  local t0=$(date +%s) rc
  echo "== $name" >> "$OUT/bench.txt"
  timeout -k 5 "$(( secs - 5 ))" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  grep -v -i "warn" "$OUT/$name.log" >> "$OUT/bench.txt"
  rm -f "$OUT/$name.log"
  echo "$name rc $rc in $(( $(date +%s) - t0 )) s" >> "$OUT/summary.txt"
}
slot() { sstart=$(date +%s); slot_s=$1; }  # a slot's limit, counted from now
left() { echo $(( slot_s - ($(date +%s) - sstart) )); }
: > "$OUT/bench.txt"
slot "$GROUPED_S"
bench step_counts "$(( $(left) * 2 / 10 ))" $PY benchmarks/step_counts.py --device cuda --json "$OUT/step_counts.json"
bench job_step_grouped "$(( $(left) * 4 / 10 ))" $PY benchmarks/job_step.py --devices cuda --batch-sizes 512 32768 \
  --repeat 5 --json "$OUT/job_step_grouped.json"
bench job_step_new_ids "$(( $(left) * 4 / 10 ))" $PY benchmarks/job_step.py --devices cuda --batch-sizes 512 32768 \
  --repeat 5 --new-ids 0.05 --json "$OUT/job_step_new_ids.json"
bench gpu_ops_train "$(left)" $PY benchmarks/gpu_ops.py --device cuda --only train --train-runs 3 --repeat 5 \
  --json "$OUT/gpu_ops_train.json"
slot "$RANKS_S"
bench distributed "$(( $(left) / 2 ))" $PY benchmarks/distributed_step.py --device cuda --backend nccl --quick \
  --background-save --json "$OUT/distributed.json"
# issue 45 item 1: the pipelined step (dynemb.train.Pipeline: the next batch's loading, copy and dedup in a side
# stream on a worker thread) against the plain loop, world 1 on NCCL; step ms and the exposed wait a step
bench distributed_pipeline "$(left)" $PY benchmarks/distributed_step.py --device cuda --backend nccl --quick --pipeline \
  --json "$OUT/distributed_pipeline.json"
slot "$TIERED_S"
bench tiered_gpu "$(left)" $PY benchmarks/tiered_gpu.py --device cuda --prefetch --json "$OUT/tiered_gpu.json"
slot "$ENGINE_S"
bench gpu_ops "$(( $(left) * 4 / 10 ))" $PY benchmarks/gpu_ops.py --device cuda --only index --json "$OUT/gpu_ops.json"
bench job_step "$(( $(left) / 2 ))" $PY benchmarks/job_step.py --devices cpu cuda --json "$OUT/job_step.json"
bench table_ops "$(left)" $PY benchmarks/table_ops.py --device cuda --quick --threads 1 --json "$OUT/table_ops.json"

echo "== summary ($(( $(date +%s) - start )) s)"
cat "$OUT/summary.txt"
grep -E "passed|failed|error" "$OUT/tests.txt" | tail -n 3
grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | cut -c1-200 | head -n 25
tail -n 40 "$OUT/bench.txt"
exit "$tests_rc"

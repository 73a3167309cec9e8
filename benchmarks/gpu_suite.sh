#!/usr/bin/env bash
# GPU tests and benchmarks in one call. Run it from the repository root: benchmarks/gpu_suite.sh [tests]
# [train] [prefix] [decode] [schedule] [profile] [same] [same-det] [memory] [memory-det] [memory-tests]
# [memory-7b] (no argument = the first five;
# prefix: rollplex bench prefix, then the suffix attention per backend by
# benchmarks/scripts/suffix_attention_probe.py; profile: rollplex bench profile, one serial GRPO step
# profiled, idle time by launcher; same: whether each schedule's update is serial's, and serial's its own
# from run to run; same-det: the same with torch's deterministic algorithms; tests: much of its time is
# compiling; memory: serial, both and auto under memory.device_budget_gib=$MEMORY_BUDGET (default 72:
# the plan an 80 GB card needs) and serial under 40 GiB, MEMORY_ROWS and MEMORY_ARGS to change them;
# memory-det: with deterministic algorithms, every memory mechanism forced on against everything
# resident, on a small workload; memory-tests: the memory layer's GPU tests; memory-7b: the 7B model,
# serial and both, 3 steps).
# Results go under $OUT (default ./gpu-results): logs, metrics and JSON tables.
# GPU_TESTS picks the test paths of the tests stage (default: all the GPU tests), e.g. to run it in two
# parts: GPU_TESTS="tests/numerics tests/schedule tests/rollout", then
# GPU_TESTS="tests/models tests/bench/test_fingerprint.py".
# SCHEDULE_ROWS picks the rows of the schedule benchmark (default: rollplex bench schedule's default rows),
# SCHEDULE_ARGS adds options (e.g. "--warmup 2 --steps 1"), SCHEDULE_NAME names its output files.
# Wheels missing from the GPU image (PyAV, rouge-score, nltk) are installed from .whl/ when present
# (benchmarks/README.md shows how to download them there).
# Python: the python3 on PATH (activate the environment that has torch first).
set -uo pipefail
usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }
gpu_tests="tests/numerics tests/schedule tests/rollout tests/models tests/bench/test_fingerprint.py"
gpu_tests="$gpu_tests tests/bench/test_profile_bench.py"
stages=${*:-tests train prefix decode schedule}
for stage in $stages; do
  case $stage in
    -h|--help) usage; exit 0 ;;
    tests|train|prefix|decode|profile|schedule|same|same-det|memory|memory-det|memory-tests|memory-7b) ;;
    *) echo "gpu_suite.sh: error: unknown stage '$stage' (expected tests, train, prefix, decode, schedule, profile, same, same-det, memory, memory-det, memory-tests, memory-7b)" >&2
       exit 2 ;;
  esac
done
if ! python3 -c "import torch" 2>/dev/null; then
  echo "gpu_suite.sh: error: python3 has no torch: activate the environment that has torch first" >&2
  exit 2
fi
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_suite.sh: error: needs a CUDA device visible to python3's torch, and none is" >&2
  exit 2
fi
OUT=${OUT:-gpu-results}
WORK=${WORK:-/tmp/rollplex-gpu}
mkdir -p "$OUT" "$WORK"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
rollplex() { python3 -m rollplex "$@"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/env.txt"
status=0
for stage in $stages; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    tests)
      # shellcheck disable=SC2086
      python3 -m pytest -q -p no:cacheprovider --durations=10 ${GPU_TESTS:-$gpu_tests} 2>&1 | tee "$OUT/tests.log" \
        || status=1 ;;
    train)
      [ -d "$WORK/3b" ] || rollplex model init --preset qwen2.5-vl-3b --out "$WORK/3b" --dtype bfloat16
      [ -d "$WORK/video" ] || rollplex data synth --out "$WORK/video" --num 16 --seed 0 \
        --width 640 --height 480 --frames 64 --fps 8 --families color,direction
      rollplex train configs/qwen2.5-vl-3b-video.yaml model.path="$WORK/3b" data.train_path="$WORK/video/train.json" \
        run.out_dir="$WORK/run-3b" run.progress=false --overwrite 2>&1 | tee "$OUT/train.log" || status=1
      cp "$WORK/run-3b/metrics.jsonl" "$OUT/train-metrics.jsonl" 2>/dev/null ;;
    prefix)
      rollplex bench prefix --out "$OUT/bench-prefix.json" 2>&1 | tee "$OUT/bench-prefix.log" || status=1
      python3 benchmarks/scripts/suffix_attention_probe.py --out "$OUT/suffix-attention.json" > "$OUT/suffix-attention.log" 2>&1 \
        || status=1 ;;
    decode)
      rollplex bench decode --out "$OUT/bench-decode.json" 2>&1 | tee "$OUT/bench-decode.log" || status=1 ;;
    profile)
      rollplex bench profile --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1 || status=1
      python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['idle'])" "$OUT/profile.json" 2>/dev/null ;;
    same)
      rollplex bench schedule --rows serial,serial-again,fusion,overlap,both --warmup 2 --steps 2 \
        --out "$OUT/same.json" 2>&1 | tee "$OUT/same.log" || status=1 ;;
    same-det)
      rollplex bench schedule --deterministic --rows serial,serial-again,both --warmup 2 --steps 2 \
        --out "$OUT/same-deterministic.json" 2>&1 | tee "$OUT/same-deterministic.log" || status=1 ;;
    memory)
      rows=${MEMORY_ROWS:-serial,both,auto,serial-40gib}
      echo "rollplex bench schedule --rows $rows --warmup 1 --steps 2 --auto-trials 1 --no-compare memory.device_budget_gib=${MEMORY_BUDGET:-72} ${MEMORY_ARGS:-}" | tee "$OUT/memory.cmd"
      # shellcheck disable=SC2086
      rollplex bench schedule --rows "$rows" --warmup 1 --steps 2 --auto-trials 1 --no-compare \
        memory.device_budget_gib="${MEMORY_BUDGET:-72}" ${MEMORY_ARGS:-} --out "$OUT/memory.json" 2>&1 \
        | tee "$OUT/memory.log" || status=1 ;;
    memory-det)
      rollplex bench schedule --deterministic --groups 2 --response-tokens 64 \
        --rows serial,serial-resident,both,both-resident --warmup 1 --steps 1 \
        memory.optimizer_offload=on memory.reference_paging=paged memory.offload_activations=on \
        memory.chunk_mib=64 --out "$OUT/memory-det.json" 2>&1 | tee "$OUT/memory-det.log" || status=1 ;;
    memory-tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/memory/test_chunked_adamw.py \
        tests/memory/test_host_pool.py tests/memory/test_residency.py 2>&1 | tee "$OUT/memory-tests.log" \
        || status=1 ;;
    memory-7b)
      rollplex bench schedule --preset qwen2.5-vl-7b --rows serial,both --warmup 1 --steps 2 --no-compare \
        ${MEMORY_ARGS:-} --out "$OUT/memory-7b.json" 2>&1 | tee "$OUT/memory-7b.log" || status=1 ;;
    schedule)
      name=${SCHEDULE_NAME:-bench-schedule}
      args=${SCHEDULE_ARGS:-}
      echo "rollplex bench schedule ${SCHEDULE_ROWS:+--rows $SCHEDULE_ROWS} $args" | tee "$OUT/$name.cmd"
      # shellcheck disable=SC2086
      rollplex bench schedule ${SCHEDULE_ROWS:+--rows "$SCHEDULE_ROWS"} $args --out "$OUT/$name.json" 2>&1 \
        | tee "$OUT/$name.log" || status=1 ;;
  esac
done
exit $status

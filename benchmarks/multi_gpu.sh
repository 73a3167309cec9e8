#!/usr/bin/env bash
# Multi-GPU runs in one call: the parallel tests on GPUs, then rollplex bench schedule under torchrun.
# Run it from the repository root: benchmarks/multi_gpu.sh [tests] [2gpu] [4gpu] [8gpu]
# (no argument: tests and every stage the visible GPUs allow).
#   tests  the GPU tests of tests/parallel (NCCL, bfloat16, torchrun on 2 GPUs)
#   2gpu   7B serial/overlap/auto at dp=2, and at tp_train=2, tp_rollout=1; serial vs disaggregated 1+1
#   4gpu   7B at tp_train=4, tp_rollout=2 with shared weights, with copied weights, and matched at tp 4;
#          serial vs disaggregated 2+2
#   8gpu   32B random weights at tp 8/4: serial, overlap, auto and disaggregated 4+4; rollplex plan's
#          predicted peak against the measured peak
# The "both" row (prefill fusion) runs only where tp_train = tp_rollout; elsewhere "overlap" stands in.
# Results go under $OUT (default ./multi-gpu-results): one log and one JSON per run.
# BENCH_ARGS adds options to every bench run (default "--warmup 2 --steps 2").
# Python: the python3 on PATH (activate the environment that has torch first).
set -uo pipefail
# NVLink multicast (NVLS) stays off: NCCL, torch's symmetric memory and NVSHMEM would otherwise use it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
if ! python3 -c "import torch" 2>/dev/null; then
  echo "multi_gpu.sh: error: python3 has no torch: activate the environment that has torch first" >&2
  exit 2
fi
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
  echo "multi_gpu.sh: error: needs at least 2 CUDA devices, python3's torch sees $gpus" >&2
  exit 2
fi
default="tests"
for n in 2 4 8; do [ "$gpus" -ge "$n" ] && default="$default ${n}gpu"; done
stages=${*:-$default}
for stage in $stages; do
  case $stage in
    -h|--help) usage; exit 0 ;;
    tests|2gpu|4gpu|8gpu) ;;
    *) echo "multi_gpu.sh: error: unknown stage '$stage' (expected tests, 2gpu, 4gpu, 8gpu)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-multi-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
BENCH_ARGS=${BENCH_ARGS:---warmup 2 --steps 2}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/env.txt"
status=0

# bench NAME GPUS PRESET ROWS [key=value ...]: rollplex bench schedule under torchrun on GPUS GPUs
bench() {
  local name=$1 n=$2 preset=$3 rows=$4
  shift 4
  echo "--- $name: $n GPUs, $preset, rows $rows, $*"
  # shellcheck disable=SC2086
  python3 -m torch.distributed.run --standalone --nproc-per-node "$n" -m rollplex bench schedule \
    --preset "$preset" --rows "$rows" $BENCH_ARGS --out "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log" \
    || status=1
}

for stage in $stages; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/parallel 2>&1 | tee "$OUT/tests.log" || status=1 ;;
    2gpu)
      bench 2gpu-7b-dp2 2 qwen2.5-vl-7b serial,both,auto parallel.dp=2
      bench 2gpu-7b-tp2-1 2 qwen2.5-vl-7b serial,overlap,auto parallel.tp_train=2 parallel.tp_rollout=1
      bench 2gpu-7b-disagg 2 qwen2.5-vl-7b serial,disaggregated parallel.dp=2 ;;
    4gpu)
      bench 4gpu-7b-tp4-2-shared 4 qwen2.5-vl-7b serial,overlap,auto parallel.tp_train=4 parallel.tp_rollout=2
      bench 4gpu-7b-tp4-2-copied 4 qwen2.5-vl-7b serial,overlap,auto parallel.tp_train=4 parallel.tp_rollout=2 \
        parallel.shared_weights=false
      bench 4gpu-7b-tp4-4 4 qwen2.5-vl-7b serial,both,auto parallel.tp_train=4 parallel.tp_rollout=4
      bench 4gpu-7b-disagg 4 qwen2.5-vl-7b serial,disaggregated parallel.dp=2 parallel.tp_train=2 parallel.tp_rollout=2 ;;
    8gpu)
      # the optimizer's FP32 state is on the device here (ZeRO-1 over dp only): a row out of memory is
      # recorded as such, and the plan below says which moves would make it fit
      bench 8gpu-32b-tp8-4 8 qwen2.5-vl-32b serial,overlap,auto,disaggregated parallel.tp_train=8 parallel.tp_rollout=4
      python3 -m rollplex plan configs/paper-32b.yaml parallel.dp=1 rollout.prompts_per_step=8 \
        rollout.max_response_tokens=512 --prompt-tokens 3920 --vision-tokens 3520 --json \
        > "$OUT/8gpu-32b-plan.json" 2> "$OUT/8gpu-32b-plan.log" || status=1
      python3 - "$OUT/8gpu-32b-plan.json" "$OUT/8gpu-32b-tp8-4.json" <<'EOF' | tee "$OUT/8gpu-32b-plan-vs-measured.txt"
import json, sys
plan, bench = (json.load(open(path)) for path in sys.argv[1:])
print(f"rollplex plan: planned peak {plan['planned_peak_gib']:.2f} GiB, naive {plan['naive_gib']:.2f} GiB")
for name, row in bench["rows"].items():
    print(f"{name}: measured peak {row.get('peak_memory_gib', float('nan')):.2f} GiB", row.get("error", ""))
EOF
      ;;
  esac
done
echo "=== done $(date -u +%FT%TZ), status $status"
exit $status

#!/usr/bin/env bash
# The GPU checks of issue 40 in one run, for a session lent a device (the `device` tool's `run`):
#   bash scripts/gpu_check.sh            # writes everything under $OUT (default: a new temp folder)
# Each step has its own timeout and a failing step does not stop the next; the step limits add up
# to 685 s, but the run took 142 s on an H200 (28 Nov), so give the device call timeout_s=480 and
# read the summary. It needs no install: the repository root on PYTHONPATH with the machine's CUDA
# torch (no Horovod, no TensorFlow). Outputs (6 files):
#   gpu_check.log   every step's output (the CUDA correctness tests' too: the tests that skip without
#                   a GPU run there), the device and versions first, a summary last
#   cuda_check.json benchmarks/cuda_check.py: every compressor on CUDA against the oracle, then timed
#   gpu_e2e.json    benchmarks/gpu_e2e.py: 2 Gloo ranks on one GPU, every spec through the three front ends
#   advise_cuda.json  hvdcompress advise --device cuda on the bench's MLP (timing that waits for the device)
#   codec_fits.json benchmarks/codec_fits.py: the codec timings the planner fits, with their samples
#   fsdp_cuda.json  benchmarks/fsdp_evidence.py on one rank over NCCL (a smoke test, not evidence)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HVDCOMPRESS_CACHE=/tmp/hvdcompress-cache HVDCOMPRESS_NATIVE_CACHE=/tmp/hvdcompress-native
LOG="$OUT/gpu_check.log"
PY=${PYTHON:-python3}
declare -A STATUS

step() {  # step NAME SECONDS COMMAND...: run it with a timeout, log its output and exit status
  local name=$1 limit=$2; shift 2
  printf '\n=== %s (timeout %ss): %s\n' "$name" "$limit" "$*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  STATUS[$name]="rc=$rc in $((SECONDS - t0)) s"
  printf '=== %s: %s\n' "$name" "${STATUS[$name]}" | tee -a "$LOG"
}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__,
'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
  git log --oneline -1 2>/dev/null || true
} 2>&1 | tee -a "$LOG"

# 1. the CUDA correctness tests (the suite's tests that need a GPU skip elsewhere; Horovod and
#    TensorFlow are absent there, so only the modules that need neither are collected): devices,
#    timers, install plan, the side stream (same results, compute stream not held), CPU tensors on
#    NCCL, the kernels' loop bounds
CUDA_TESTS=(tests/test_devices.py tests/test_timers.py tests/test_light_install.py tests/test_install_plan.py
            tests/test_streams.py tests/test_dist_devices.py tests/test_profiling_device.py)
for f in tests/test_*cuda*.py tests/test_*fused*.py; do [ -e "$f" ] && CUDA_TESTS+=("$f"); done
step pytest 100 "$PY" -m pytest -q -rs -p no:cacheprovider "${CUDA_TESTS[@]}"

# 2. every compressor on CUDA against the oracle, then timed (10M and 25M entries)
step cuda_check 120 "$PY" benchmarks/cuda_check.py --sizes 1e7 2.5e7 --repeats 5 --json "$OUT/cuda_check.json"

# 3. end to end: 2 Gloo ranks sharing the GPU, every spec through the DDP hook, the optimizer and
#    DiLoCo, oracle replay, step time against plain DDP; NCCL with world size 1
step gpu_e2e 180 "$PY" benchmarks/gpu_e2e.py --device cuda --steps 3 --timing-steps 10 --out "$OUT/gpu_e2e.json"

# 4. advise timing compute and codecs on the GPU (the timers that wait for the device)
step advise_cuda 45 "$PY" -m hvdcompress.bench.advise --model mlp --device cuda --quick --json "$OUT/advise_cuda.json"

# 5. the Triton kernels under the machine's own Triton interpreter (CPU work, last: the GPU
#    results above do not wait for it)
# 5. the codec timings the planner fits on the device, with their samples (benchmarks/codec_fits.py)
step codec_fits 60 "$PY" benchmarks/codec_fits.py --device cuda --json "$OUT/codec_fits.json"

# 6. FSDP2 on CUDA over NCCL, one rank (a smoke test of the compressing reduce-scatter's CUDA path)
step fsdp_cuda 60 "$PY" benchmarks/fsdp_evidence.py --workers 1 --device cuda --configs plain,int8,4bit,fp16 \
  --steps 4 --warmup 1 --json "$OUT/fsdp_cuda.json"

TRITON_TESTS=()
for f in tests/test_*triton*.py; do [ -e "$f" ] && TRITON_TESTS+=("$f"); done
step triton_interp 120 "$PY" -m pytest -q -rs -p no:cacheprovider "${TRITON_TESTS[@]}"

printf '\n=== summary\n' | tee -a "$LOG"
for name in pytest cuda_check gpu_e2e advise_cuda codec_fits fsdp_cuda triton_interp; do
  printf '%-12s %s\n' "$name" "${STATUS[$name]:-not run}" | tee -a "$LOG"
done
ls -la "$OUT" | tee -a "$LOG"

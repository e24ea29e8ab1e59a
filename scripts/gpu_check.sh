#!/usr/bin/env bash
# The GPU validation run (used on the lent 2xH200 / H100 hosts): NCCL distributed tests with the Triton backend,
# native kernel and CUDA-graph tests, then the benchmarks. Results and logs go under $OUT (default ./gpu_out).
# Usage: scripts/gpu_check.sh [tests|bench_ops|bench_generate|bench_moe|bench_serving|all]...
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
step() { echo "=== $1 ($(date +%T))" | tee -a "$OUT/summary.log"; }
for what in "${@:-all}"; do
  case $what in
    tests|all)
      step "pytest: kernels, gpu, distributed over NCCL + triton ($NGPU GPUs)"
      TP_LORA_TEST_DEVICE=cuda TP_LORA_TEST_BACKEND=triton timeout 300 python3 -m pytest -q -x \
        tests/kernels tests/gpu tests/distributed/test_layers.py tests/distributed/test_model.py \
        tests/distributed/test_collectives.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -5 | tee -a "$OUT/summary.log" ;;&
    bench_generate|all)
      step "bench_generate tp=1"
      timeout 300 python3 scripts/bench_generate.py --out "$OUT" 2>&1 | tee "$OUT/bench_generate.log" | tail -8 \
        | tee -a "$OUT/summary.log"
      if [ "$NGPU" -ge 2 ]; then
        step "bench_generate tp=2 fully sharded"
        timeout 200 torchrun --nproc_per_node=2 scripts/bench_generate.py --tp 2 --no-hf --fully-sharded \
          --out "$OUT/tp2" 2>&1 | tee "$OUT/bench_generate_tp2.log" | tail -6 | tee -a "$OUT/summary.log"
      fi ;;&
    bench_ops|all)
      step "bench_lora_ops"
      timeout 300 python3 scripts/bench_lora_ops.py --out "$OUT/ops" 2>&1 | tee "$OUT/bench_ops.log" | tail -12 \
        | tee -a "$OUT/summary.log" ;;&
    *) ;;
  esac
done

#!/usr/bin/env bash
# The GPU validation run (used on the lent 2xH200 / H100 hosts): NCCL distributed tests with the Triton backend,
# native kernel and CUDA-graph tests, then the benchmarks. Each step has its own time limit so one slow step cannot
# eat the others; logs and results go under $OUT (default ./gpu_out), packed at the end into $OUT/results.tgz
# (the lent host returns few files), re-packed after every step so a run cut short still returns what finished.
# Usage: scripts/gpu_check.sh [tests|bench_generate|bench_step|bench_moe|bench_serving|bench_ops|all]...
#   bench_serving is serving_tp1 serving_admit1 serving_tp2 serving_base; each can be named alone.
#   gpu_suite (2-4 GPUs, one call): the whole multi-GPU test suite over NCCL with the Triton backend, its wall time.
#   tp_scaling (2-4 GPUs, ~6 minutes: a call of its own): issue 36's collective microbenchmarks at the host's rank
#   count (all-reduce, the fused all-reduce + add + RMSNorm, all-gather), the Llama-3-8B decode-step table at tp1 /
#   tp2 / tp4 with and without 32 adapters (on 4 GPUs tp1 runs on GPU 3 beside tp2 on GPUs 0-1; tp1's and tp4's
#   kernel tables side by side), and the 70B-shaped 8-layer stack at the host's tp. tp_collectives: the microbenchmarks
#   alone. tp_fused (2 GPUs, one call with tp_collectives): the fused collectives' GPU tests, 8B tp1
#   / tp2 fused with kernel tables (tp1 against tp2), the 70B-shaped stack at tp2, 8B tp2 unfused.
#   On 2 GPUs, the rows that only a 2-GPU host gives, in two calls of under 10 minutes:
#   `tests step_tp2 bench_moe`, then `moe_decode_2gpu serving_http_tp2`.
#   MoE across GPUs (issue 37): on 2 GPUs one call `moe2 moe_tests` (~7 minutes: the 2-GPU table tp1, tp2, ep2,
#   tp2_ep2 with NCCL rows and kernel tables, then the GPU tests: EP peer collectives, graphed = eager in every layout,
#   MoE parity against one process); on a 4-GPU host `moe4` (tp1 baseline, tp4, ep4, ep2_tp2, tp4_ep4) in a call of
#   its own (adapters in both LoRA modes), then `moe_tests` (adds the 4-GPU layouts). `moe_plan` (one GPU, ~2
#   minutes): the routing plan alone at decode to mixed-step sizes, torch's sort against the Triton kernels' launch
#   settings. `race` (one GPU, ~1 minute): the sampler's race alone (bench_race.py). `moe_engine` (2 or 4 GPUs, ~5
#   minutes): the same shape's decode step through the engine in every layout, run ahead and not.
#   The open issues' unmeasured targets on one GPU, in calls of under 10 minutes: `pending_a` (GPU tests of the
#   paths never run on a GPU, fp8, DoRA, n / grammar), `pending_b` (prefix caching at moderate load and saturated),
#   `pending_c` (HTTP against offline at 1 / 100 / 1000 adapters).
#   FP8 (issue 38), one GPU, two calls: `fp8_tune` (the kernels' configuration sweep), then `fp8` (per-layer GEMM
#   table, greedy agreement, the 8B decode table).
#   `fp8_kv` (issue 38 item 3, one GPU, ~10 minutes at most): the paged attention tests natively (fp8 caches), the
#   bf16 against fp8 KV attention rows (batch 32, contexts 2048 / 4096 / 8192, floors), the 8B
#   decode step at context 8192 with bf16 weights + KV and with fp8 weights + KV, the decode attention rows at tp
#   head counts.
#   `gemm70` (issue 36, one GPU, ~3 minutes): the 70B shape's tp4 decode GEMMs at 32 rows against their floor.
#   `ws70` (issue 36, 2-4 GPUs, ~6 minutes): the 70B-shaped 8-layer stack at the host's tp with cuBLAS's workspace
#   off and on, a kernel table each, side by side.
#   `fp8_moe` (issue 38 item 5, one GPU, ~3 minutes): the Qwen3-30B-A3B-shaped decode (24 layers) with bf16 against
#   fp8 experts and layers and against fp8 experts beside bf16 attention, with and without adapters.
#   Issue 39's serving features alone, one call of under 8 minutes: `serve39` (the steps `sampling`: n=8 and
#   json_schema with its mask wait; tests/gpu/test_serving_features.py; `prefix_moderate`: TTFT at 5
#   conversations/s; `prefix_saturated`).
set -uo pipefail
OUT=${OUT:-gpu_out}
RES="$OUT/results"
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
step() { echo "=== $1 ($(date +%T))" | tee -a "$OUT/summary.log"; }
# run NAME SECONDS TAIL_LINES cmd...: the command's whole log under results/, its tail in the summary.
run() {
  local name=$1 limit=$2 lines=$3; shift 3
  timeout "$limit" "$@" > "$RES/$name.log" 2>&1
  echo "rc=$? after $SECONDS s" >> "$RES/$name.log"
  tail -n "$lines" "$RES/$name.log" | tee -a "$OUT/summary.log"
  tar czf "$OUT/results.tgz" -C "$OUT" results
}
serving_args="--model llama-2048 --ranks 16 --rate 0 --requests 256 --max-loras 64 --batch 64"
for what in "${@:-all}"; do
  case $what in
    tests|all)
      step "pytest: kernels, gpu, distributed over NCCL + triton ($NGPU GPUs)"
      TP_LORA_TEST_DEVICE=cuda TP_LORA_TEST_BACKEND=triton run pytest_gpu 300 6 python3 -m pytest -q -rs \
        tests/kernels tests/gpu tests/unit/test_attention.py tests/serving/test_slots.py tests/distributed/test_layers.py tests/distributed/test_model.py \
        tests/distributed/test_collectives.py tests/distributed/test_moe.py ;;&
    bench_generate|all)
      step "bench_generate tp=1 (with transformers + PEFT)"
      run bench_generate 240 10 python3 scripts/bench_generate.py --out "$RES/gen_tp1"
      if [ "$NGPU" -ge 2 ]; then
        step "bench_generate tp=2 fully sharded"
        run bench_generate_tp2 150 8 torchrun --nproc_per_node=2 scripts/bench_generate.py --tp 2 --no-hf \
          --fully-sharded --out "$RES/gen_tp2"
      fi ;;&
    bench_step|all)
      step "bench_step: decode step vs its memory floor (llama-2048), mixed step"
      run bench_step 400 24 python3 scripts/bench_step.py --shapes llama-2048 --mixed --out "$RES/step" ;;&
    step_tp2)
      step "bench_step tp=2: Llama-3-8B shape, batch 32, context 2048"
      run bench_step_tp2 240 8 torchrun --nproc_per_node=2 scripts/bench_step.py --tp 2 --shapes llama3-8b \
        --batches 32 --contexts 2048 --out "$RES/step_tp2" ;;
    tp_scaling|tp_collectives)
      step "issue 36: all-reduce, all-reduce + add + RMSNorm (fused) and all-gather in a CUDA graph, $NGPU ranks"
      run allreduce_$NGPU 100 40 torchrun --nproc_per_node=$NGPU scripts/bench_allreduce.py --iters 30 --reps 10 \
        --out "$RES/allreduce_$NGPU" ;;&
    tp_fused)
      step "issue 36: the fused all-reduce + norm and the peer all-gather against NCCL (2 GPUs)"
      TP_LORA_TEST_DEVICE=cuda run pytest_allreduce 90 6 python3 -m pytest -q -rs tests/distributed/test_allreduce.py \
        -k "fused"
      step "issue 36: Llama-3-8B decode step, tp1 / tp2 fused with a kernel table each; 70B-shaped 8 layers at tp2"
      for spec in 1:auto 2:symm_mem 2:unfused; do
        n=${spec%%:*} ar=${spec#*:}
        extra=$([ "$ar" = unfused ] && echo "--allreduce symm_mem --no-peer-kernels" || echo "--allreduce $ar --kernels")
        run step_tp${n}_$ar 110 4 torchrun --nproc_per_node=$n scripts/bench_step.py --tp $n --shapes llama3-8b \
          --batches 32 --contexts 128,2048 --prefix-caching off --in-memory --no-adapters-only --reps 1 $extra \
          --out "$RES/step_tp${n}_$ar"
        if [ "$spec" = 2:symm_mem ]; then
          python3 scripts/bench_step.py --scaling "$RES"/step_tp*/bench_step.json | tee -a "$OUT/summary.log"
          python3 scripts/bench_step.py --kernel-compare "$RES"/step_tp1_auto/bench_step.json \
            "$RES"/step_tp2_symm_mem/bench_step.json | tee -a "$OUT/summary.log"
          run step70_tp2 110 4 torchrun --nproc_per_node=2 scripts/bench_step.py --tp 2 --shapes llama3-70b-8l \
            --batches 32 --contexts 128,2048 --prefix-caching off --no-adapters-only --reps 1 --out "$RES/step70_tp2"
        fi
      done
      python3 scripts/bench_step.py --scaling "$RES"/step_tp*/bench_step.json | tee -a "$OUT/summary.log" ;;
    tp_scaling)
      step "issue 36: Llama-3-8B decode step at tp1 / tp2 / tp4 (symm_mem all-reduce, fused kernels), batch 32, adapters"
      # tp_args N ALLREDUCE: bench_step's arguments of the tp-N row
      tp_args() { echo --tp $1 --shapes llama3-8b --batches 32 --contexts 128,2048 --prefix-caching off --in-memory \
        --allreduce $2 --reps 1 --out "$RES/step_tp$1_$2"; }
      if [ "$NGPU" -ge 4 ]; then  # tp1 on GPU 3 beside tp2 on GPUs 0-1: separate GPUs, graphed steps, one host
        CUDA_VISIBLE_DEVICES=3 run step_tp1_auto 200 4 torchrun --nproc_per_node=1 --master_port 29511 \
          scripts/bench_step.py $(tp_args 1 auto) --kernels &
        CUDA_VISIBLE_DEVICES=0,1 run step_tp2_symm_mem 200 4 torchrun --nproc_per_node=2 scripts/bench_step.py \
          $(tp_args 2 symm_mem) --kernels
        wait
        run step_tp4_symm_mem 200 4 torchrun --nproc_per_node=4 scripts/bench_step.py $(tp_args 4 symm_mem) --kernels
        python3 scripts/bench_step.py --kernel-compare "$RES"/step_tp1_auto/bench_step.json \
          "$RES"/step_tp4_symm_mem/bench_step.json > "$RES/kernels_tp1_tp4.log" 2>&1
      else
        for n in 1 2; do
          [ "$NGPU" -ge $n ] || continue
          ar=$([ $n = 1 ] && echo auto || echo symm_mem)
          run step_tp${n}_$ar 200 4 torchrun --nproc_per_node=$n scripts/bench_step.py $(tp_args $n $ar)
        done
      fi
      python3 scripts/bench_step.py --scaling "$RES"/step_tp*/bench_step.json | tee -a "$OUT/summary.log"
      step "issue 36: 8 layers of the Llama-3-70B shape (random weights in memory), batch 32, tp$NGPU"
      run step70_tp$NGPU 120 4 torchrun --nproc_per_node=$NGPU scripts/bench_step.py --tp $NGPU \
        --shapes llama3-70b-8l --batches 32 --contexts 128,2048 --prefix-caching off --no-adapters-only --reps 1 \
        --out "$RES/step70_tp$NGPU" ;;
    gpu_suite)
      step "issue 36: the multi-GPU suite over NCCL + triton ($NGPU GPUs): tests/distributed, tests/gpu, multi-rank parity"
      start=$SECONDS
      # what the suite imports beyond the GPU image (gpu-wheels.sh --serve lacks jsonschema and pytest-xdist)
      python3 -c 'import importlib.util as u; m=[n for n in ("jsonschema", "openai", "fastapi", "xdist", "peft")
if u.find_spec(n) is None]; print("gpu_suite: missing modules", m) if m else None' | tee -a "$OUT/summary.log"
      # Files spread over 4 pytest workers where pytest-xdist is installed (each file's tests stay in one worker, so
      # its module fixtures and rank pools are made once, unless a test names a group of its own: tests/conftest.py;
      # each process takes a bounded share of every GPU: tp_lora.testing.share_gpus). -v with a clock on every line:
      # each test's end time survives a run cut short.
      export XDIST=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 4 --dist loadgroup")
      suite() {
        python3 -m pytest -v -rs --durations=15 $XDIST tests/distributed tests/gpu tests/parity/test_families_parity.py \
          tests/parity/test_adapter_kinds_parity.py 2>&1 | while IFS= read -r l; do printf "%s %s\n" "$(date +%T)" "$l"; done
      }
      export -f suite
      TP_LORA_TEST_DEVICE=cuda TP_LORA_TEST_BACKEND=triton TP_LORA_TEST_FAILURES="$RES/pytest_suite_failures.log" \
        run pytest_suite 540 45 bash -c suite
      echo "gpu_suite: $((SECONDS - start)) s wall on $NGPU GPUs" | tee -a "$OUT/summary.log" ;;
    moe_decode_2gpu)
      step "bench_moe_decode on 2 GPUs: Qwen3-30B-A3B (48 layers) and Mixtral (16 layers), mixed steps too"
      run moe_decode_qwen3 240 12 torchrun --nproc_per_node=2 scripts/bench_moe_decode.py --prefill 512 \
        --out "$RES/moe_decode_qwen3"
      run moe_decode_mixtral 200 12 torchrun --nproc_per_node=2 scripts/bench_moe_decode.py --model mixtral-8x7b \
        --layers 16 --prefill 512 --out "$RES/moe_decode_mixtral" ;;
    moe4)
      step "issue 37: bench_moe_decode on 4 GPUs, Qwen3-30B-A3B shape (24 layers: tp1 fits one GPU), mixed steps too"
      [ "$NGPU" -ge 4 ] && run moe_decode_4gpu 400 16 torchrun --nproc_per_node=4 scripts/bench_moe_decode.py \
        --layouts tp1,tp4,ep4,ep2_tp2,tp4_ep4 --layers 24 --prefill 512 --iters 10 \
        --lora-modes default,fully_sharded --out "$RES/moe_decode_4gpu" ;;
    moe2)
      step "issue 37: bench_moe_decode on 2 GPUs (Qwen3 shape, 24 layers: tp1 fits one H100), ep2 / tp2_ep2 with every"
      step "  collective on NCCL beside the peer-memory rows, each case's kernels per graphed decode and mixed step"
      [ "$NGPU" -ge 2 ] && run moe_decode_2gpu24 560 40 torchrun --nproc_per_node=2 scripts/bench_moe_decode.py \
        --layouts ep2,tp1,tp2,tp2_ep2 --nccl-layouts ep2,tp2_ep2 --layers 24 --prefill 512 --profile \
        --out "$RES/moe_decode_2gpu24" ;;
    moe_plan)
      step "issue 37: the routing plan alone, torch's sort against the Triton kernels, decode to mixed-step sizes"
      run moe_plan 240 20 python3 scripts/bench_moe_plan.py --out "$RES/moe_plan" ;;
    race)
      step "the token draw's race alone: gathered logits (plain, grammar rows), a tp2 rank's shard + combine"
      run race 180 40 python3 scripts/bench_race.py --out "$RES/race" ;;
    moe_engine)
      step "issue 37: the MoE decode step through the engine (Qwen3 shape, 24 layers), every layout of $NGPU GPUs,"
      step "  steps run ahead against read one by one"
      run moe_engine_$NGPU 400 16 torchrun --nproc_per_node=$NGPU scripts/bench_moe_engine.py --out "$RES/moe_engine" ;;
    moe_tests)
      step "issue 37: EP collectives on peer memory vs NCCL; graphed MoE steps vs eager (decode and mixed, every"
      step "  layout of the GPUs present); MoE parity over NCCL + peer memory against one process"
      TP_LORA_TEST_DEVICE=cuda TP_LORA_TEST_BACKEND=triton run pytest_moe 560 8 python3 -m pytest -q -rs \
        tests/gpu/test_moe_graphs.py tests/distributed/test_moe.py ;;
    moe_decode_hf)
      step "bench_moe_decode tp1 with transformers + PEFT beside ours: Qwen3-30B-A3B shape, 24 layers"
      run moe_decode_hf 300 12 torchrun --nproc_per_node=1 scripts/bench_moe_decode.py --layouts tp1 --layers 24 \
        --hf --iters 10 --out "$RES/moe_decode_hf" ;;
    serving_http_tp2)
      step "bench_serving tp=2: offline engine, then the HTTP server, 1024 requests at 250/s"
      run serving_offline_tp2 200 8 torchrun --nproc_per_node=2 scripts/bench_serving.py --tp 2 --model llama-2048 \
        --ranks 16 --rate 250 --requests 1024 --max-loras 64 --batch 64 --adapters 1,100,1000 --systems ours \
        --out "$RES/serv_offline_tp2"
      run serving_http_tp2 300 8 python3 scripts/bench_serving.py --server --tp 2 --clients 8 --model llama-2048 \
        --ranks 16 --rate 250 --requests 1024 --max-loras 64 --batch 64 --adapters 1,100,1000 --systems server \
        --out "$RES/serv_http_tp2" ;;
    bench_moe|all)
      step "bench_moe on $NGPU GPUs"
      run bench_moe 200 30 torchrun --nproc_per_node="$NGPU" scripts/bench_moe.py --graphs --gemms grouped,loop \
        --out "$RES/moe"
      if [ "$NGPU" -ge 2 ]; then
        step "bench_moe_decode: Qwen3-30B-A3B shape, tp2 / ep2 / tp2_ep2"
        run bench_moe_decode 200 10 torchrun --nproc_per_node=2 scripts/bench_moe_decode.py --out "$RES/moe_decode"
      fi ;;&
    bench_serving|serving_tp1|all)
      step "bench_serving tp=1: ours at 1/100/1000 adapters"
      run bench_serving_tp1 200 12 python3 scripts/bench_serving.py $serving_args --adapters 1,100,1000 \
        --systems ours --repeats 3 --out "$RES/serv_tp1" ;;&
    bench_serving|serving_admit1|all)
      step "bench_serving tp=1, admissions not grouped (scheduler.admit_batch=1)"
      run bench_serving_admit1 200 12 python3 scripts/bench_serving.py $serving_args --adapters 1,100,1000 \
        --systems ours --admit-batch 1 --out "$RES/serv_tp1_admit1" ;;&
    bench_serving|serving_tp2|all)
      if [ "$NGPU" -ge 2 ]; then
        step "bench_serving tp=2"
        run bench_serving_tp2 200 12 torchrun --nproc_per_node=2 scripts/bench_serving.py $serving_args --tp 2 \
          --adapters 1,100,1000 --systems ours --repeats 3 --out "$RES/serv_tp2"
      fi ;;&
    bench_serving|serving_base|all)
      step "bench_serving baselines at 1/100 adapters: merged into the weights, transformers + PEFT"
      run bench_serving_base 150 12 python3 scripts/bench_serving.py $serving_args --adapters 1,100 \
        --systems merged,peft --out "$RES/serv_base" ;;&
    bench_ops|all)
      step "bench_lora_ops"
      run bench_ops 300 12 python3 scripts/bench_lora_ops.py --out "$RES/ops" ;;&
    pending_a)
      step "pytest on CUDA + triton: kernels (fp8 GEMMs), graphs, run-ahead, prefix cache, adapter kinds"
      TP_LORA_TEST_DEVICE=cuda TP_LORA_TEST_BACKEND=triton run pytest_pending 240 8 python3 -m pytest -q -rs -x \
        tests/kernels tests/gpu tests/serving/test_run_ahead.py tests/serving/test_prefix_cache.py \
        tests/parity/test_adapter_kinds_parity.py --ignore=tests/gpu/test_serving_features.py
      step "#39 on CUDA: grammar rows launched ahead, n siblings' fork, the device mask (mask wait printed)"
      run pytest_serving_features 120 12 python3 -m pytest -q -rs -s tests/gpu/test_serving_features.py
      step "fp8 (#30): GEMM paths against bf16 and the fp8 floor; greedy agreement; decode step fp8 / fp8 KV"
      run fp8_gemm 90 40 python3 scripts/bench_fp8_gemm.py --rows 1,32,64,128,2048 --out "$RES/fp8"
      run fp8_check 60 8 python3 scripts/gpu_fp8_check.py
      run fp8_step 150 12 python3 scripts/bench_step.py --shapes llama3-8b --batches 32 --contexts 128,2048 \
        --quantization none,fp8 --kv-cache-dtype auto,fp8 --out "$RES/fp8_step"
      step "DoRA (#32): decode stack with 32 DoRA vs plain adapters, rank 16 and 128"
      run dora 60 12 python3 scripts/bench_dora.py --out "$RES/dora"
      run dora_r128 60 12 python3 scripts/bench_dora.py --rank 128 --out "$RES/dora_r128"
      ;;&
    pending_a|serve39|sampling)
      step "n and structured output (#31, #39): tokens/s, documents parsed / cut / malformed, mask wait per step"
      run sampling 150 20 python3 scripts/bench_sampling.py --shape llama-2048 --reps 5 --out "$RES/sampling"
      step "  the same, one round with the host's time per step by phase (--timeline: its wrappers cost host time)"
      run sampling_timeline 80 12 python3 scripts/bench_sampling.py --shape llama-2048 --reps 1 --timeline \
        --out "$RES/sampling_timeline" ;;&
    serve39)
      step "#39 on CUDA: grammar rows ahead, n siblings' fork, the device mask, no host sync in the draw"
      run pytest_serving_features 100 12 python3 -m pytest -q -rs -s tests/gpu/test_serving_features.py ;;&
    pending_b|serve39|prefix_moderate)
      step "prefix caching (#39) at moderate load: TTFT with and without caching, where it goes (chat trace only)"
      run prefix_moderate 260 8 python3 scripts/bench_prefix.py --shapes llama-2048 --rate 5 --think-s 0.5 \
        --conversations 150 --traces chat --orders cached --out "$RES/prefix_moderate" ;;&
    pending_b|serve39|prefix_saturated)
      step "prefix caching (#39) saturated: arrivals faster than the GPU (cached first against arrival order), and"
      step "  the random trace (what caching costs)"
      run prefix_saturated 130 12 python3 scripts/bench_prefix.py --shapes llama-2048 --rate 100 --think-s 0 \
        --conversations 50 --out "$RES/prefix_saturated" ;;
    pending_c)
      step "HTTP against offline (#31) at 1 / 100 / 1000 adapters"
      run serving_http 300 12 python3 scripts/bench_serving.py --server --systems ours,server --clients 8 \
        --model llama-2048 --ranks 16 --rate 250 --requests 1024 --max-loras 64 --batch 64 \
        --adapters 1,100,1000 --out "$RES/serving_http" ;;
    fp8_tune)
      step "issue 38: the fp8 GEMM kernels' configuration sweep (w8a16_mm at 32 rows then 1 / 16 / 64, w8a8_mm at 2048)"
      run fp8_tune 420 80 python3 scripts/tune_fp8_gemm.py --out "$RES/fp8_tune"
      step "  the grouped expert GEMM's act8 sweep (fp8 experts, Qwen3-30B-A3B layer, 32 / 128 tokens)"
      run fp8_tune_experts 150 12 python3 scripts/tune_fp8_gemm.py --experts --out "$RES/fp8_tune_experts" ;;
    fp8)
      step "issue 38 (one GPU, one call): fp8 GEMM paths per layer vs bf16 and the fp8 floor, MoE experts; greedy"
      step "  agreement; Llama-3-8B decode step b32, bf16 / fp8 weights / + fp8 KV at ctx 128 and 8192, adapters"
      run fp8_gemm 150 75 python3 scripts/bench_fp8_gemm.py --out "$RES/fp8"
      run fp8_check 90 8 python3 scripts/gpu_fp8_check.py
      # weights drawn in memory (no 16 GB checkpoint written)
      run fp8_step 300 12 python3 scripts/bench_step.py --shapes llama3-8b --batches 32 --contexts 8192,128 \
        --quantization none,fp8 --kv-cache-dtype auto,fp8 --no-adapters-only --reps 1 --in-memory \
        --out "$RES/fp8_step"
      run fp8_step_lora 120 8 python3 scripts/bench_step.py --shapes llama3-8b --batches 32 --contexts 128 \
        --quantization none,fp8 --reps 2 --in-memory --out "$RES/fp8_step_lora" ;;
    fp8_kv)
      step "fp8 KV (#38 item 3): the attention kernels over fp8 caches natively (inline-PTX widening), bf16 vs fp8 KV"
      TP_LORA_TEST_DEVICE=cuda TP_LORA_TEST_BACKEND=triton run pytest_fp8_kv 120 6 python3 -m pytest -q -rs \
        tests/kernels/test_paged_attention.py tests/kernels/test_paged_varlen.py tests/unit/test_fp8_kv.py \
        tests/unit/test_attention.py
      run bench_fp8_kv 120 18 python3 scripts/bench_attention.py --kind fp8_kv --out "$RES/attention_fp8_kv"
      # Issue 38's whole-step target at ctx 8192: bf16 weights + bf16 KV against fp8 + fp8, each in a process of its
      # own (the four combinations in one process ran out of memory on an H100)
      for spec in none:auto fp8:fp8; do
        run step_8192_${spec/:/_} 150 4 python3 scripts/bench_step.py --shapes llama3-8b --batches 32 --contexts 8192 \
          --reps 1 --quantization ${spec%%:*} --kv-cache-dtype ${spec#*:} --prefix-caching off --in-memory \
          --no-adapters-only --out "$RES/step_8192_${spec/:/_}"
      done
      step "decode attention at the tp head counts (#36): 32/8, 16/4, 8/2 heads per rank, contexts 128 / 512 / 2048"
      run attention_tp 90 14 python3 scripts/bench_attention.py --kind tp --out "$RES/attention_tp" ;;
    gemm70)
      step "issue 36: the 70B shape's per-rank decode GEMMs at tp4 (cuBLAS and our split-K GEMM against the floor)"
      run gemm70 240 16 python3 scripts/bench_decode_gemm.py --model llama3-70b --tp 4 --rows 32 \
        --out "$RES/gemm70" ;;
    ws70)
      step "issue 36: 8 layers of the Llama-3-70B shape at tp$NGPU, batch 32: cuBLAS without a workspace (the default"
      step "  of CUDA runs) against CUBLAS_WORKSPACE_CONFIG=:4096:8 (split-K allowed), a kernel table each"
      for ws in :0:0 :4096:8; do
        CUBLAS_WORKSPACE_CONFIG=$ws run step70_ws${ws//:/_} 170 6 torchrun --nproc_per_node=$NGPU scripts/bench_step.py \
          --tp $NGPU --shapes llama3-70b-8l --batches 32 --contexts 128,2048 --prefix-caching off --no-adapters-only \
          --reps 1 --kernels --out "$RES/step70_ws${ws//:/_}"
      done
      python3 scripts/bench_step.py --kernel-compare "$RES"/step70_ws_0_0/bench_step.json \
        "$RES"/step70_ws_4096_8/bench_step.json | tee -a "$OUT/summary.log" ;;
    fp8_moe)
      step "issue 38 item 5: Qwen3-30B-A3B shape (24 layers), one GPU, bf16 against fp8 experts and layers"
      run moe_decode_fp8 300 16 torchrun --nproc_per_node=1 scripts/bench_moe_decode.py --layouts tp1 --layers 24 \
        --quantization none,fp8,fp8_experts --iters 10 --out "$RES/moe_decode_fp8" ;;
    *) ;;
  esac
done
rm -rf "$RES"

#!/usr/bin/env bash
# One call on the lent GPU machine (see ../shared/gpu-kit/README.md): after the kit's
# parts were received, verify the op on the GPU and measure. Everything lands in $OUT
# (or ./gpu-out) as logs; the last lines printed are the summaries.
#   carry: .gpukit/gpukit.sh .gpukit/MANIFEST capsnet/lib build .gpudata
#   command: bash scripts/gpu_session.sh [verify|bench|train|all|scale|precision|profile|xla|xla-profile|guard|sweep|
#                                         full_mnist|fast_grid|fast_time|crop|runs|conv|blocks|final|ab|memory|memory_ab|cmdbuf|step_dump|ncu_routing|max_batch|kernels|ratio]   (scale, sweep: on nvidia-h200-x2, not in all)
set -uo pipefail
what="${1:-all}"
out="${OUT:-gpu-out}"; mkdir -p "$out"
source .gpukit/gpukit.sh env >/dev/null || exit 1
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2 PYTHONPATH="$PWD:$PYTHONPATH"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/device.txt"

# Runs side by side on the one GPU: each line of $RUNS is "name overrides...". Rerunning the same
# call resumes them (same run dirs, while the machine is held); finished runs are evaluated once
# (final checkpoint, op and matmul path; with EVAL_TTA="flip shift" also with those test-time
# views, flip only for runs trained with data.flip=true), all evaluations at once, so their
# start-ups (TensorFlow, compiling) overlap instead of adding up. Their logs, histories and
# evaluations come back packed in $out/runs.tgz (a call brings back a few files only: nine
# runs' 45 files did not come back), written once training ends and again after the
# evaluations, so a call cut short still returns what was packed. With them, each evaluated
# run's shell, <name>.run, which scripts/compare_runs.py reads as it reads a run dir (its
# seeds' table, means, paired differences).
# One group a GPU (CUDA_VISIBLE_DEVICES; each group's logs in /tmp/runs-out-gpu<N>), after one
# `source .gpukit/gpukit.sh env` (groups started together race to unpack the kit: with four,
# one failed on tar's "File exists", forty-fourth session):
#   source .gpukit/gpukit.sh env >/dev/null
#   CUDA_VISIBLE_DEVICES=0 OUT=$OUT/g0 RUNS="$g0" bash scripts/gpu_session.sh runs &
#   CUDA_VISIBLE_DEVICES=1 OUT=$OUT/g1 RUNS="$g1" bash scripts/gpu_session.sh runs & wait
# The code tree of an ab / memory_ab turn: old = $AB_OLD (an earlier commit's capsnet/, scripts/,
# configs/, train.py, unpacked there; default ab_old), new = this one.
tree_dir() { if [[ $1 == old ]]; then echo "${AB_OLD:-ab_old}"; else echo .; fi; }

side_by_side() {
  # Each process takes GPU memory as it needs it (TensorFlow's default, all of it, leaves the
  # others "cudaSetDevice() ... out of memory").
  export TF_FORCE_GPU_ALLOW_GROWTH=true
  local name args logs=/tmp/runs-out${CUDA_VISIBLE_DEVICES:+-gpu$CUDA_VISIBLE_DEVICES}
  mkdir -p "$logs"
  while read -r name args; do
    [[ -z $name ]] && continue
    # timeout's SIGTERM: train.py finishes and saves the epoch it is in (a few seconds), then exits.
    timeout "${TRAIN_TIMEOUT:-540}" python3 train.py $args train.progress_bar=false hydra.run.dir="/tmp/runs/$name" \
      >> "$logs/$name.log" 2>&1 &  # appended: a resuming call keeps the earlier calls' lines
  done <<< "$RUNS"
  wait
  while read -r name args; do
    [[ -z $name ]] && continue
    local run="/tmp/runs/$name"
    # The last tested epoch's line (train.test_every_epochs > 1 leaves the others without test results).
    echo "$name: $(cat "$run/history.jsonl" 2>/dev/null | wc -l) epochs; $(grep '^epoch [0-9]*:.*| test loss' "$logs/$name.log" | tail -1 | cut -c1-160)"
    cp "$run/history.jsonl" "$logs/$name.history.jsonl" 2>/dev/null
  done <<< "$RUNS"
  tar czf "$out/runs.tgz" -C "$logs" .
  [[ ${EVALUATE:-1} == 1 ]] || return 0
  while read -r name args; do
    [[ -z $name ]] && continue
    local run="/tmp/runs/$name"
    # Evaluated once: a call that resumes unfinished runs leaves the runs with both reports
    # (an evaluation that failed, its JSON missing, runs again).
    [[ -f "$run/metrics.json" ]] || continue
    [[ -f "$logs/${name}_eval_op_true.json" && -f "$logs/${name}_eval_op_false.json" ]] && continue
    cp "$run/metrics.json" "$logs/$name.metrics.json"
    for op in true false; do
      python3 evaluate.py checkpoint="$run" which=latest custom_op=$op output="$logs/${name}_eval_op_$op.json" \
        > "$logs/${name}_eval_op_$op.log" 2>&1 &
    done
    local tta ttas
    read -ra ttas <<< "${EVAL_TTA:-}"
    for tta in "${ttas[@]}"; do  # test-time views: flip (runs trained with data.flip=true), shift
      python3 evaluate.py checkpoint="$run" which=latest custom_op=true "tta=$tta" \
        output="$logs/${name}_eval_tta_$tta.json" > "$logs/${name}_eval_tta_$tta.log" 2>&1 &
    done
  done <<< "$RUNS"
  wait
  while read -r name args; do  # each evaluation's last line: its JSON report, or the error
    [[ -n $name ]] && for report in "$logs/${name}"_eval_*.log; do
      [[ -f $report ]] && echo "$(basename "$report" .log): $(tail -1 "$report" | cut -c1-200)"
    done
  done <<< "$RUNS"
  # Each finished run's shell, <name>.run: its config.yaml and history.jsonl, and its op-path
  # report where evaluate.py's default output would be. The run dirs stay on this machine;
  # unpacked, the shells are what scripts/compare_runs.py reads:
  #   scripts/compare_runs.py 'W15=<unpacked>/w15_*.run' 'W30=<unpacked>/w30_*.run'
  while read -r name args; do
    local run="/tmp/runs/$name" shell="$logs/$name.run" last
    [[ -n $name && -f $run/metrics.json && -f $logs/${name}_eval_op_true.json ]] || continue
    last=$(tail -1 "$run/history.jsonl" | python3 -c "import json, sys; print(json.load(sys.stdin)['epoch'])")
    mkdir -p "$shell/checkpoints/latest"
    cp "$run/config.yaml" "$run/history.jsonl" "$shell/"
    cp "$logs/${name}_eval_op_true.json" "$shell/checkpoints/latest/ckpt-$last.eval.json"
    rm -f "$logs/$name.history.jsonl"  # the shell has it; the loose copy is for runs not evaluated yet
  done <<< "$RUNS"
  tar czf "$out/runs.tgz" -C "$logs" .
}

if [[ $what == verify || $what == all ]]; then
  # The op tests on the GPU (gpu-marked ones run only here; test_xla_op: the op inside XLA) and the model's op-vs-matmul test.
  python3 -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_routing_op.py tests/test_xla_op.py tests/test_layers.py tests/test_model.py 2>&1 | tee "$out/pytest_gpu.log" | tail -15
fi
if [[ $what == train || $what == all ]]; then
  # A short real run with the compiled op on /GPU:0.
  python3 train.py custom_op=true data.dir=.gpudata/mnist train.epochs=2 train.batch_size=128 \
    hydra.run.dir=/tmp/gpu-run 2>&1 | tee "$out/train_gpu.log" | tail -8
  python3 evaluate.py checkpoint=/tmp/gpu-run custom_op=false 2>&1 | tail -1 | tee "$out/eval_matmul.json"
  python3 evaluate.py checkpoint=/tmp/gpu-run custom_op=true 2>&1 | tail -1 | tee "$out/eval_op.json"
fi
if [[ $what == bench || $what == all ]]; then
  python3 scripts/benchmark_ops.py --device gpu 2>&1 | tee "$out/benchmark_ops.log" | tail -40
  # One call per step and train()'s default of 50 steps per call.
  python3 scripts/benchmark_train.py --steps-per-execution 1,50 --json "$out/benchmark_train.json" 2>&1 \
    | tee "$out/benchmark_train.log" | tail -30
fi
if [[ $what == precision ]]; then
  # [precision]: every train.precision on the fastest paths, 50 steps per call as train() runs,
  # then where the step's GPU time goes in float32 and in bfloat16 (scripts/profile_train.py).
  python3 scripts/benchmark_train.py --precision float32,mixed_bfloat16,mixed_float16 --steps-per-execution 50 \
    --repeats 3 --variants op+fused,op+fused+autocluster,matmul,matmul+jit --json "$out/benchmark_precision.json" \
    2>&1 | tee "$out/benchmark_precision.log" | tail -32
fi
if [[ $what == profile ]]; then
  for spec in "op+fused float32" "op+fused mixed_bfloat16" "matmul+jit mixed_bfloat16"; do
    set -- $spec
    python3 scripts/profile_train.py --variant "$1" --precision "$2" --batch-size 512 \
      --json "$out/profile_${1}_${2}.json" 2>&1 | tee "$out/profile_${1}_${2}.log" | grep -v "^W0000\|^I0000" | tail -30
  done
fi
if [[ $what == xla ]]; then
  # [xla-op]: the ops inside XLA on the GPU (forward, gradient, every dtype), then the
  # whole-step jit with the op against the other paths, float32 and bfloat16, 50 steps per call.
  python3 -m pytest -q -p no:cacheprovider tests/test_xla_op.py 2>&1 | tee "$out/pytest_xla_gpu.log" | tail -4
  python3 scripts/benchmark_train.py --precision float32,mixed_bfloat16 --steps-per-execution 50 --repeats 3 \
    --variants op+fused+jit,op+jit,op+fused,matmul+jit --json "$out/benchmark_xla.json" \
    2>&1 | tee "$out/benchmark_xla.log" | tail -24
fi
if [[ $what == xla-profile ]]; then
  # Where the jit step's GPU time goes now, then a short real-data run with it.
  for spec in "op+fused+jit float32 512" "op+fused+jit mixed_bfloat16 512" "op+fused+jit float32 128"; do
    set -- $spec
    python3 scripts/profile_train.py --variant "$1" --precision "$2" --batch-size "$3" \
      --json "$out/profile_${1}_${2}_$3.json" 2>&1 | tee "$out/profile_${1}_${2}_$3.log" | grep -v "^W0000\|^I0000" | tail -22
  done
  python3 train.py custom_op=true train.xla=jit data.dir=.gpudata/mnist train.epochs=2 train.batch_size=128 \
    hydra.run.dir=/tmp/gpu-run-jit 2>&1 | tee "$out/train_gpu_jit.log" | grep -v "^W0000\|^I0000" | tail -6
  python3 evaluate.py checkpoint=/tmp/gpu-run-jit custom_op=false 2>&1 | tail -1 | cut -c1-200
fi
if [[ $what == crop ]]; then
  # PrimaryCaps' crop of the rows no window reaches (capsnet/layers.py), on and off in one
  # run: a copy of the package with the crop disabled, then this tree, same variants.
  rm -rf /tmp/nocrop && mkdir /tmp/nocrop && cp -r capsnet scripts configs hydra_plugins /tmp/nocrop/
  sed -i 's/if (used_h, used_w) != tuple(inputs.shape\[1:3\]):/if False:  # crop off (A\/B)/' /tmp/nocrop/capsnet/layers.py
  grep -c "crop off" /tmp/nocrop/capsnet/layers.py
  for tree in /tmp/nocrop "$PWD"; do
    (cd "$tree" && python3 scripts/benchmark_train.py --precision float32,mixed_bfloat16 --steps-per-execution 50 \
      --repeats 5 --variants ${CROP_VARIANTS:-op+fused} --json "$out/crop_$(basename "$tree").json" 2>/dev/null | tail -5)
  done
fi
if [[ $what == guard ]]; then
  # [reliability]: what the non-finite guard costs the step (the gradients' global norm; the loop's
  # check on the stacked values runs either way), each row with and without it, in the same process.
  python3 scripts/benchmark_train.py --precision ${PRECISIONS:-mixed_bfloat16,float32} --steps-per-execution 50 --repeats 5 \
    --variants op+fused,op+fused+jit --guard on,off --json "$out/benchmark_guard.json" \
    2>&1 | tee "$out/benchmark_guard.log" | tail -20
fi
if [[ $what == conv ]]; then
  # [precision]/[xla-op]: the two convolutions by part (forward, filter and input gradient), the
  # larger part of the step, with and without XLA, PrimaryCaps' three forms, both precisions and
  # the benchmark batches; then PyTorch's kernels for the same shapes (its own process).
  for batch in 128 512; do
    python3 scripts/benchmark_conv.py --device gpu --dtype float32,bfloat16 --batch-size $batch --repeats 20 \
      --form strided,cropped,space_to_depth --json "$out/benchmark_conv_$batch.json" 2>&1 \
      | tee "$out/benchmark_conv_$batch.log" | grep "^|"
    python3 scripts/benchmark_conv.py --device gpu --dtype float32,bfloat16 --batch-size $batch --repeats 20 \
      --framework torch --json "$out/benchmark_conv_torch_$batch.json" 2>&1 \
      | tee "$out/benchmark_conv_torch_$batch.log" | grep "^|"
  done
fi
if [[ $what == blocks ]]; then
  # model.primary_caps_conv strided and space_to_depth (two processes, one after the other; the
  # default, auto, is the first without XLA and the second with it), the fastest paths, both
  # precisions, 50 steps per call as train() runs.
  for form in strided space_to_depth; do
    python3 scripts/benchmark_train.py --precision ${PRECISIONS:-mixed_bfloat16,float32} --steps-per-execution 50 \
      --repeats 3 --variants ${BLOCK_VARIANTS:-op+fused+jit,matmul+jit,op+fused} --timeout 240 \
      --json "$out/benchmark_blocks_$form.json" model.primary_caps_conv=$form 2>&1 \
      | tee "$out/benchmark_blocks_$form.log" | grep "^|"
  done
fi
if [[ $what == ab ]]; then
  # Two code trees taking turns per variant: $AB_OLD (an earlier commit's capsnet/, scripts/,
  # configs/, train.py, unpacked there; or . for this tree) and this one; then each tree's
  # profile of the jit step at batch 512 in $AB_PROFILE_PRECISION (default mixed_bfloat16; per-kernel
  # GPU time: less noisy than images/s between processes). The old tree loads $AB_OLD_LIB (an earlier build of the op library,
  # carried) if given, else the same library.
  lib="$PWD/capsnet/lib/_capsnet_ops.so"
  old_lib="$PWD/${AB_OLD_LIB:-capsnet/lib/_capsnet_ops.so}"
  declare -A tree_lib=([old]="$old_lib" [new]="$lib")
  for variant in ${AB_VARIANTS:-op+fused+jit matmul+jit}; do
    for tree in old new; do
      dir=$(tree_dir "$tree")
      (cd "$dir" && CAPSNET_OP_LIBRARY="${tree_lib[$tree]}" python3 scripts/benchmark_train.py --precision ${AB_PRECISIONS:-mixed_bfloat16,float32} \
        --steps-per-execution 50 --repeats 3 --variants "$variant" --timeout 300 --json "$OLDPWD/$out/ab_${tree}_${variant//+/_}.json") \
        2>&1 | tee "$out/ab_${tree}_${variant//+/_}.log" | grep "^|" | sed "s/^/$tree /"
    done
  done
  for tree in $([[ ${AB_PROFILE:-1} == 1 ]] && echo old new); do
    dir=$(tree_dir "$tree")
    (cd "$dir" && CAPSNET_OP_LIBRARY="${tree_lib[$tree]}" python3 scripts/profile_train.py --variant op+fused+jit \
      --precision ${AB_PROFILE_PRECISION:-mixed_bfloat16} --batch-size 512) 2>&1 | tee "$out/ab_profile_$tree.log" | tail -22 | sed "s/^/$tree /"
  done
fi
if [[ $what == memory ]]; then
  # What XLA's plan of the jit step holds at its peak (scripts/xla_memory_report.py), batch 512.
  for spec in "op+fused+jit float32" "matmul+jit float32" "op+fused+jit mixed_bfloat16"; do
    set -- $spec
    echo "### $1 $2"
    python3 scripts/xla_memory_report.py --device gpu --variant "$1" --precision "$2" --batch-size 512 2>&1 \
      | tee "$out/memory_$1_$2.md" | head -40
  done
fi
if [[ $what == memory_ab ]]; then
  # XLA's plan of the jit step (scripts/xla_memory_report.py) in $AB_OLD's tree and this one,
  # for $MEMORY_VARIANTS in $MEMORY_PRECISION at batch 512: what a change did to the plan.
  for variant in ${MEMORY_VARIANTS:-op+fused+jit matmul+jit}; do
    for tree in old new; do
      dir=$(tree_dir "$tree")
      echo "### $tree $variant ${MEMORY_PRECISION:-float32}"
      (cd "$dir" && python3 scripts/xla_memory_report.py --device gpu --variant "$variant" \
        --precision ${MEMORY_PRECISION:-float32} --batch-size 512 --top 12) > "$out/memory_${tree}_${variant//+/_}.md" 2>&1
      head -${MEMORY_LINES:-8} "$out/memory_${tree}_${variant//+/_}.md"
    done
  done
fi
if [[ $what == cmdbuf ]]; then
  # XLA's command buffers (CUDA graphs of the step's kernels): TensorFlow's defaults, XLA's list
  # without custom calls, and none; one process each, taking turns ($CB_ROUNDS). Measured in the
  # thirteenth session with the op's handlers marked command-buffer compatible: no gain beyond
  # the spread between processes (docs/benchmarks.md), so the mark was not kept.
  for round in $(seq ${CB_ROUNDS:-1}); do
    for spec in "default|" "no_custom_call|--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN" \
                "none|--xla_gpu_enable_command_buffer="; do
      name=${spec%%|*}
      XLA_FLAGS="${spec#*|}" \
        python3 scripts/benchmark_train.py --precision ${PRECISIONS:-mixed_bfloat16,float32} --steps-per-execution 50 \
        --repeats 3 --variants ${CB_VARIANTS:-op+fused+jit} --timeout 300 --json "$out/cmdbuf_${name}_$round.json" \
        2>&1 | tee "$out/cmdbuf_${name}_$round.log" | grep "^|" | sed "s/^/$name /"
    done
  done
  tar czf "$out/cmdbuf.tgz" -C "$out" $(cd "$out" && ls cmdbuf_* 2>/dev/null)
fi
if [[ $what == step_dump ]]; then
  # The jit train step as XLA compiled it on this GPU (after-optimizations HLO, buffer
  # assignment) packed for reading elsewhere, with its memory report.
  dump=/tmp/step_dump; rm -rf "$dump"
  python3 scripts/xla_memory_report.py --device gpu --keep "$dump" --variant ${DUMP_VARIANT:-op+fused+jit} \
    --precision ${DUMP_PRECISION:-float32} --batch-size ${DUMP_BATCH:-512} --top 30 > "$out/step_dump_report.md" 2>&1
  head -12 "$out/step_dump_report.md"
  tar czf "$out/step_dump.tgz" -C "$dump" $(cd "$dump" && ls | grep train_step | grep -E "after_optimizations.txt|buffer-assignment.txt")
fi
if [[ $what == kernels ]]; then
  # A kernel change checked on the GPU: the driver's checks against its host reference, the
  # same under compute-sanitizer (memcheck, racecheck, synccheck), the TensorFlow op tests on
  # /GPU:0, and the fused routing timed alone (build/sanitize_driver: python
  # scripts/build_ops.py --driver-only; carry build/sanitize_driver).
  build/sanitize_driver > "$out/driver_checks.txt" 2>&1; echo "driver exit $?"; tail -1 "$out/driver_checks.txt"
  grep FAIL "$out/driver_checks.txt" | head -20
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool $tool --error-exitcode 3 build/sanitize_driver > "$out/sanitize_$tool.txt" 2>&1
    echo "compute-sanitizer $tool exit $?: $(tail -1 "$out/sanitize_$tool.txt")"
  done
  python3 -m pytest -q -p no:cacheprovider tests/test_routing_op.py tests/test_ops.py 2>&1 | tee "$out/pytest_gpu.log" | tail -5
  for shape in paper batch512; do
    build/sanitize_driver --bench --routing --shape $shape | tee -a "$out/routing_bench.txt" | grep "^| $shape"
  done
fi
if [[ $what == ncu_routing ]]; then
  # Nsight Compute on the fused routing op's kernels at batch 512, float and bfloat16
  # (build/sanitize_driver: python scripts/build_ops.py --driver-only; carry build/sanitize_driver).
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  "$ncu" --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --print-summary per-kernel build/sanitize_driver --bench --routing --shape batch512 --iters 1 --repeats 1 \
    > "$out/ncu_routing.txt" 2>&1
  build/sanitize_driver --bench --routing --shape batch512 | tee "$out/routing_bench.txt"
  gzip -k "$out/ncu_routing.txt"; grep -E "Routing|Grad|Duration|Achieved Occupancy|Registers Per|Compute \(SM\) Throughput|Memory Throughput|Theoretical Occ|No Eligible|Issued Warp" "$out/ncu_routing.txt" | head -120
fi
if [[ $what == ratio ]]; then
  # [xla-op]: custom_op=true against custom_op=false, both whole-step jit, in $RATIO_PRECISION
  # (default float32): $ROUNDS rounds of one benchmark process per path and batch (the paths take
  # turns, so the spread between processes shows), then where each path's step at batch 128 goes.
  for round in $(seq ${ROUNDS:-2}); do
    python3 scripts/benchmark_train.py --precision ${RATIO_PRECISION:-float32} --steps-per-execution 50 --repeats 3 \
      --variants op+fused+jit,matmul+jit --batch-sizes 128,512 --timeout 300 --json "$out/ratio_round$round.json" \
      2>&1 | tee "$out/ratio_round$round.log" | grep "^|" | sed "s/^/round $round /"
  done
  for variant in op+fused+jit matmul+jit; do
    python3 scripts/profile_train.py --variant $variant --precision ${RATIO_PRECISION:-float32} --batch-size 128 \
      --json "$out/ratio_profile_${variant//+/_}.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -24
  done
fi
if [[ $what == max_batch ]]; then
  # [xla-op]: the largest batch that trains on this GPU, per path (float32, whole-step jit): each
  # batch of $MAX_BATCHES (ascending) in its own process, two steps; the first failure ends a path,
  # and its line says why (out of memory, or $MAX_TIMEOUT s). Compiling and autotuning take
  # minutes at these sizes: 205 s at 8,192 (matmul path), ~7.5 min at 16,384, where both paths
  # train (twenty-sixth session, H100): one batch a 10-minute call from there. MAX_AUTOTUNE=0 compiles without
  # XLA's autotuning (--xla_gpu_autotune_level=0: default algorithms): it shows what fits in
  # memory, not speed, and needs minutes a probe: the untuned convolutions took 97 s a step
  # at 8,192 (seventeenth session; tuned, 4,096 runs at ~82,000 images/s).
  [[ ${MAX_AUTOTUNE:-} == 0 ]] && export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
  for variant in ${MAX_VARIANTS:-op+fused+jit matmul+jit}; do
    for batch in ${MAX_BATCHES:-16384 24576 32768 40960}; do
      if python3 scripts/benchmark_train.py --variants "$variant" --precision ${MAX_PRECISION:-float32} \
          --batch-sizes "$batch" --steps 2 --warmup 1 --repeats 1 --timeout ${MAX_TIMEOUT:-540} > "/tmp/max_${variant}_$batch.log" 2>&1 \
          && grep -q "^| custom_op" "/tmp/max_${variant}_$batch.log"; then
        echo "max_batch $variant $batch: trains: $(grep "^| custom_op" "/tmp/max_${variant}_$batch.log")"
      else
        echo "max_batch $variant $batch: fails: $( (grep -m1 "failed:" "/tmp/max_${variant}_$batch.log" || tail -1 "/tmp/max_${variant}_$batch.log") | cut -c1-240)"
        break
      fi
    done
  done | tee "$out/max_batch.txt"
fi
if [[ $what == final ]]; then
  # The defaults as a user gets them (model.primary_caps_conv=auto), every main path, both
  # precisions; first the tests of what changed, on the GPU.
  python3 -m pytest -q -p no:cacheprovider tests/test_conv.py tests/test_layers.py tests/test_xla_op.py 2>&1 \
    | tee "$out/pytest_final.log" | tail -4
  python3 scripts/benchmark_train.py --precision mixed_bfloat16,float32 --steps-per-execution 50 --repeats 3 \
    --variants ${FINAL_VARIANTS:-op+fused+jit,matmul+jit,op+fused,matmul} --timeout 240 --json "$out/benchmark_final.json" \
    2>&1 | tee "$out/benchmark_final.log" | grep "^|"
fi
if [[ $what == bench-jit-routing || $what == all ]]; then
  # The op variants with the routing iterations compiled by XLA on their own.
  python3 scripts/benchmark_train.py --variants op,op+autocluster --json "$out/benchmark_train_jit_routing.json" \
    model.jit_routing=true 2>&1 | tee "$out/benchmark_train_jit_routing.log" | tail -12
fi
if [[ $what == scale ]]; then
  # Issue #6: training images/s on 1 GPU and on 2 (MirroredStrategy), custom_op=true and false,
  # per-GPU batch 128 and 512, 1 and 50 steps per call; the 2-GPU rows with NCCL (auto: under
  # a jit variant since 2026-11-26 the all-reduce inside each replica's compiled step, xla,
  # except in mixed_float16; else TensorFlow's collective; name collective or xla to pick
  # one) and without
  # (one_device). [xla-op]'s target (custom_op=true at its fastest, per-GPU 512):
  # SCALE_VARIANTS=op+fused+jit,matmul+jit SCALE_BATCHES=512 SCALE_ALL_REDUCE=collective,xla
  # (SCALE_PRECISION: one precision a run; SCALE_SPE: steps per call, train()'s default 50 alone
  # halves the call). Each mirrored row first checks that its all-reduce sums, and every row
  # shows its loss at the first and last step, each replica on the 1-device row's batch
  # (docs/benchmarks.md, twenty-first session: a fresh 2×512 random-label draw did not train).
  # NVLink multicast stays off, here and in every process started from here (KINDS.md: a
  # program using it can take the host's shared GPUs out of service for a day or more).
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  # TensorFlow dlopens libnccl.so.2 and the kit leaves NCCL out: the CUDA 12 build TensorFlow was
  # built against if its parts were sent (scripts/pack_nccl.sh), else the machine's PyTorch's
  # (a CUDA 13 build). NCCL_DEBUG=VERSION prints the version that ran.
  kit=/tmp/ncclkit
  if [[ -f $kit/MANIFEST ]] && ! cmp -s $kit/MANIFEST $kit/lib/MANIFEST && (cd $kit && sha256sum -c --quiet MANIFEST); then
    # The parts MANIFEST lists, in its order; unpacked beside, then moved: no half library
    # stays, and lib/MANIFEST says which parts the library came from (new parts: unpack again).
    mkdir -p $kit/lib && rm -f $kit/lib/MANIFEST
    (cd $kit && cat $(awk '{print $2}' MANIFEST)) | python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
      > $kit/lib/libnccl.so.2.part && mv $kit/lib/libnccl.so.2.part $kit/lib/libnccl.so.2 && cp $kit/MANIFEST $kit/lib/MANIFEST
  fi
  if [[ -f $kit/lib/MANIFEST ]] && cmp -s $kit/MANIFEST $kit/lib/MANIFEST; then
    nccl_so=$kit/lib/libnccl.so.2
  else
    echo "NCCL: no complete parts in $kit (scripts/pack_nccl.sh), or unpacking them failed: falling back on" \
      "PyTorch's CUDA 13 NCCL" | tee "$out/nccl.txt"
    torch_nvidia="$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia"))' 2>/dev/null)"
    nccl_so="$(find "$torch_nvidia" -name 'libnccl.so*' 2>/dev/null | head -1)"
  fi
  if [[ -n $nccl_so ]]; then export LD_LIBRARY_PATH="$(dirname "$nccl_so")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
  # NCCL writes its lines to stdout, which the benchmark's workers keep for their JSON: stderr.
  export NCCL_DEBUG="${NCCL_DEBUG:-VERSION}" NCCL_DEBUG_FILE="${NCCL_DEBUG_FILE:-/dev/stderr}"
  echo "NCCL: ${nccl_so:-not found (the auto rows will fail; one_device runs without it)}" | tee -a "$out/nccl.txt"
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' | tee -a "$out/nccl.txt"
  # one_device first and a per-variant timeout: should NCCL hang, the rows before it still come back.
  python3 scripts/benchmark_scale.py --replicas 2 --all-reduce "${SCALE_ALL_REDUCE:-one_device,auto}" \
    --variants "${SCALE_VARIANTS:-op+fused,matmul}" --batch-sizes "${SCALE_BATCHES:-128,512}" \
    --precision "${SCALE_PRECISION:-float32}" --steps-per-execution "${SCALE_SPE:-1,50}" \
    --timeout 300 --json "$out/benchmark_scale.json" 2>&1 | tee "$out/benchmark_scale.log" | tail -30
fi
if [[ $what == sweep ]]; then
  # [multi-gpu]: a 4-seed sweep as before (Hydra's basic launcher: one job after another, one
  # process) and with hydra/launcher=gpus (the jobs at once, one process per GPU); the wall
  # time of each, then each job's final accuracy and images/s.
  args=(seed=0,1,2,3 data.dir=.gpudata/mnist train.epochs="${EPOCHS:-2}" train.batch_size=128 train.progress_bar=false)
  for mode in sequential parallel; do
    launcher=(); [[ $mode == parallel ]] && launcher=(hydra/launcher=gpus)
    start=$(date +%s.%N)
    python3 train.py -m "${args[@]}" "${launcher[@]}" hydra.sweep.dir="/tmp/sweeps/$mode" > "$out/sweep_$mode.log" 2>&1
    status=$?
    echo "$mode: exit $status, $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s wall" | tee -a "$out/sweep.txt"
    for job in /tmp/sweeps/$mode/*/; do
      name="$(basename "$job")"
      cp "$job/output.log" "$out/sweep_${mode}_$name.output.log" 2>/dev/null
      echo "  $name: $(python3 -c 'import json, sys; m = json.load(open(sys.argv[1])); print("test_accuracy", m["test_accuracy"], "images/s", round(m["images_per_sec"]))' "$job/metrics.json" 2>&1 | tail -1)"
    done | tee -a "$out/sweep.txt"
  done
fi
if [[ $what == paper_mnist || $what == paper_fashion_mnist ]]; then
  # An [accuracy] run: the experiment preset on the real IDX files (.gpudata = a copy of
  # ../shared/data), the compiled op with XLA-compiled routing. Rerunning the same call
  # resumes it (same run dir) if the time limit cut it.
  data=.gpudata/mnist; [[ $what == paper_fashion_mnist ]] && data=.gpudata/fashion-mnist
  run="/tmp/runs/$what"
  timeout "${TRAIN_TIMEOUT:-540}" python3 train.py experiment="$what" data.dir="$data" custom_op=true \
    model.jit_routing=true hydra.run.dir="$run" > "$out/$what.log" 2>&1
  echo "train exit $?"; grep "^epoch [0-9]*:" "$out/$what.log" | tail -3
  if [[ -f "$run/metrics.json" ]]; then
    for op in true false; do
      python3 evaluate.py checkpoint="$run" which=latest custom_op=$op output="$out/${what}_eval_op_$op.json" 2>&1 | tail -1 | cut -c1-160
    done
  fi
  tar -czf "$out/${what}_run.tgz" -C "$run" --exclude checkpoints .
fi
if [[ $what == precision_accuracy ]]; then
  # [precision]: experiment=paper_mnist in float32 and in mixed_bfloat16, seeds 0-2 side by side
  # on the one GPU (each alone leaves it mostly idle at batch 100).
  RUNS="$(for precision in float32 mixed_bfloat16; do for seed in ${SEEDS:-0 1 2}; do
    echo "paper_mnist_${precision}_$seed experiment=paper_mnist data.dir=.gpudata/mnist custom_op=true train.precision=$precision seed=$seed ${EPOCHS:+train.epochs=$EPOCHS}"
  done; done)"
  side_by_side
fi

if [[ $what == full_mnist ]]; then
  # [accuracy-full]: experiment=paper_mnist on all 60,000 training images, seeds 0-4 side by side.
  RUNS="$(for seed in ${SEEDS:-0 1 2 3 4}; do
    echo "full_mnist_$seed experiment=paper_mnist data.dir=.gpudata/mnist custom_op=true seed=$seed ${EXTRA:-}"; done)"
  side_by_side
fi
if [[ $what == fast_grid ]]; then
  # [accuracy-full] time to accuracy: which short schedule reaches 99.6% on MNIST in the fewest
  # images (epochs), side by side (their speed here says nothing: they share the GPU).
  EVALUATE=0 RUNS="${GRID:-
fast_b128_lr2_d80 experiment=paper_mnist data.dir=.gpudata/mnist custom_op=true train.precision=mixed_bfloat16 train.epochs=15 train.batch_size=128 train.learning_rate=0.002 train.lr_decay_rate=0.8
fast_b256_lr3_d80 experiment=paper_mnist data.dir=.gpudata/mnist custom_op=true train.precision=mixed_bfloat16 train.epochs=15 train.batch_size=256 train.learning_rate=0.003 train.lr_decay_rate=0.8
fast_b512_lr4_d80 experiment=paper_mnist data.dir=.gpudata/mnist custom_op=true train.precision=mixed_bfloat16 train.epochs=15 train.batch_size=512 train.learning_rate=0.004 train.lr_decay_rate=0.8
fast_b256_lr2_d85 experiment=paper_mnist data.dir=.gpudata/mnist custom_op=true train.precision=mixed_bfloat16 train.epochs=15 train.batch_size=256 train.learning_rate=0.002 train.lr_decay_rate=0.85}"
  side_by_side
fi
if [[ $what == fast_time ]]; then
  # Time to accuracy: wall seconds from `python3 train.py` start (imports, data loading and
  # compilation included) to the end of each epoch, the process alone on the GPU. Each
  # stdout line is stamped with the seconds since the start.
  for seed in ${SEEDS:-0}; do
    name="fast_time_${TAG:-}$seed"; run="/tmp/runs/$name"; rm -rf "$run"
    start=$(date +%s.%N)
    python3 train.py experiment=${FAST_EXPERIMENT:-fast_mnist} data.dir=.gpudata/mnist seed=$seed ${EXTRA:-} \
      train.progress_bar=false hydra.run.dir="$run" 2>&1 \
      | python3 -u -c 'import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin: print(f"{time.time() - t0:8.2f} {line}", end="", flush=True)' "$start" > "$out/$name.log"
    echo "$name:"; grep "^ *[0-9.]* epoch [0-9]*:" "$out/$name.log" | cut -c1-150
    cp "$run/history.jsonl" "$out/$name.history.jsonl" 2>/dev/null
  done
fi
if [[ $what == runs ]]; then
  # Any runs side by side: RUNS="name overrides...\nname overrides..." (see side_by_side).
  side_by_side
fi

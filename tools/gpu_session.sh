#!/usr/bin/env bash
# The GPU runs behind docs/results.md and docs/benchmarks.md, in stages, on a machine with one CUDA GPU.
#   bash tools/gpu_session.sh check pretrain ablations   # GPU tests; pretrain moe-240m; the paper tools
#   bash tools/gpu_session.sh pretrain rl                # pretrain again (a fresh machine), GRPO curves
#   bash tools/gpu_session.sh pretrain stability         # the 300-step RL stability study, detached; then
#   WAIT_S=560 bash tools/gpu_session.sh stability-wait  # in each following call (machine still held): poll, collect
#   GPU_TESTS="tests/kernels" bash tools/gpu_session.sh check  # a subset of the GPU tests (correctness only: it may
#                                                        # share the GPU with the study's runs); GPU_TESTS_K="a or b"
#                                                        # is pytest's -k (check, kernel-tests)
#   bash tools/gpu_session.sh kernels                    # kernel GPU tests, then MoE layer / dense / refit benches,
#                                                        # then the v3 tile sweep: kernel-tests, kernel-bench and
#                                                        # kernel-sweep, one call each on a held machine
#   bash tools/gpu_session.sh sglang                     # SGLang server: agreement, weight updates, throughput
#   PLUGIN_BENCH=0 SGLANG_ARGS="--stages profile --precisions w4a4_rac --max-bs 64 \
#       --server-args=--disable-prefill-cuda-graph" bash tools/gpu_session.sh sglang  # kernels per decode
#                                                        # step, FP8 server against QUADS (batch 64)
#   PLUGIN_BENCH=0 SGLANG_ARGS="--stages speed --precisions w4a4_rac w4a4 --num-layers 48 --batches 1 8 64 \
#       --max-bs 64 --server-args=--disable-prefill-cuda-graph" bash tools/gpu_session.sh sglang
#                                                        # every server on dummy weights (no checkpoint on disk):
#                                                        # throughput and the decode profile at full depth; five
#                                                        # servers of 48 layers exceed one call: run
#                                                        # `--precisions w4a4_rac --baselines fp8 bf16`, then
#                                                        # `--precisions w4a4 w4a16 --baselines` on the held machine
#   bash tools/gpu_session.sh pretrain sglang-grpo grpo  # the GRPO job (R3 on) with --sglang-launch rollouts,
#                                                        # then the same job with the local engine
# Needs megatron-core (and transformers >= 5.19) importable; OUT (default runs/gpu) receives logs, JSON, PNG.
# Sizes are env-overridable for a quick probe: PRETRAIN_ITERS, RL_ITERS, NUM_PROMPTS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CKPT=${CKPT:-runs/moe-240m-hf}
STUDY=runs/rl_stability
# the study's runs: every row once, the two naive W4A4 rows twice; STABILITY_ROWS="row,row" runs a subset
# (when seven runs do not fit one held machine, the rest go to a later one)
STUDY_RUNS=(--seeds 1 --naive-seeds 1,2 ${STABILITY_ROWS:+--rows "$STABILITY_ROWS"})
PRETRAIN_ITERS=${PRETRAIN_ITERS:-250}
RL_ITERS=${RL_ITERS:-50}
NUM_PROMPTS=${NUM_PROMPTS:-64}
RL_FLAGS=(--sft-iters 60 --sft-batch-size 64 --sft-lr 3e-4 --rollout-batch-size 16 --n-samples-per-prompt 8
          --eval-interval 10 --lr 2e-5)
stage() { echo "=== $1 $(date +%T)"; }
K_ARGS=(${GPU_TESTS_K:+-k "$GPU_TESTS_K"})   # pytest's -k for the test stages (an expression with spaces stays one word)
# megatron-core and transformers >= 5.19 from a carried .whl, beside the image's torch, for every stage
# (once per machine: stability-wait is called again and again on the held one)
if [ -d .whl ]; then
  [ -d /tmp/sglang-site/megatron ] || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/sglang-site .whl/*.whl
  export PYTHONPATH=".:/tmp/sglang-site:${PYTHONPATH:-}"
fi
# SGLang's slim wheel set (tools/sglang_wheelhouse.sh -> .whl-sglang, carried), installed beside the image's
# torch; the server runs with SLIM_IMAGE_ENV.
with_sglang() {
  [ -d .whl-sglang ] || { echo "no .whl-sglang: run tools/sglang_wheelhouse.sh and carry it"; return 1; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sglang-site \
      .whl-sglang/*.whl || return 1
  export PYTHONPATH=".:/tmp/sglang-site"
  eval "$($PY -c 'from quads_megatron.rl.engines.sglang_launch import SLIM_IMAGE_ENV as e
print(" ".join(f"export {k}={v};" for k, v in e.items()))')"
}
for s in "$@"; do
  case $s in
    check-rl)
      stage check-rl
      $PY -m pytest -q -p no:cacheprovider -m gpu tests/rl/test_gpu.py 2>&1 | tee "$OUT/gpu_rl_tests.log" | tail -4 ;;
    check)
      # every GPU test; the SGLang ones (server, CUDA graphs) run when .whl-sglang was carried, else skip
      stage check
      [ -d .whl-sglang ] && { with_sglang || exit 1; }
      # the whole log goes to $OUT first, so a call cut at its limit still brings back what passed and failed
      timeout "${TESTS_S:-540}" $PY -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests} "${K_ARGS[@]}" 2>&1 \
          | tee "$OUT/gpu_tests.log" | tail -25 ;;
    pretrain)
      stage pretrain
      if [ -f "$CKPT/quads_manifest.json" ]; then echo "reusing $CKPT (this machine pretrained it already)"; continue; fi
      $PY -m quads_megatron.apps.pretrain --preset moe-240m --train-iters "$PRETRAIN_ITERS" --micro-batch-size 64 \
          --seq-length 256 --save "$CKPT" --force --no-progress 2>&1 | grep -v -i warn | tee "$OUT/pretrain.log" | tail -3 ;;
    ablations)
      stage activation_error
      $PY tools/paper_activation_error.py --hf-checkpoint "$CKPT" --num-prompts "$NUM_PROMPTS" --seq-length 64 \
          --max-new-tokens 24 --out-json "$OUT/activation_error.json" --out-png "$OUT/activation_error.png" \
          2>&1 | grep -v -i warn | tail -12
      stage rac_sweep
      $PY tools/paper_rac_sweep.py --hf-checkpoint "$CKPT" --num-prompts "$NUM_PROMPTS" --seq-length 64 \
          --max-new-tokens 24 --out-json "$OUT/rac_sweep.json" --out-png "$OUT/rac_sweep.png" 2>&1 | grep -v -i warn | tail -13
      stage throughput
      $PY tools/paper_throughput.py --hf-checkpoint "$CKPT" --batch-size 64 --seq-length 192 --max-new-tokens 128 \
          --out-json "$OUT/throughput.json" --out-png "$OUT/throughput.png" 2>&1 | grep -v -i warn | tail -6 ;;
    rl)
      stage rl_stability
      $PY tools/paper_rl_stability.py --hf-checkpoint "$CKPT" --seq-length 48 --max-new-tokens 16 \
          --out-json "$OUT/rl_stability.json" --out-png "$OUT/rl_stability.png" -- --train-iters "$RL_ITERS" \
          "${RL_FLAGS[@]}" 2>&1 | grep -E "summary|wrote|Error|error" | tail -8 ;;
    kernels)
      # issue 25 in one machine: the three stages below (over 600 s together: one call each on a held machine)
      bash "$0" kernel-tests kernel-bench kernel-sweep ;;
    kernel-tests)
      # the GPU tests (kernels, loaders, engines; SGLang's skip without its wheel set)
      stage kernel-tests
      timeout "${TESTS_S:-240}" $PY -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests} "${K_ARGS[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    kernel-bench)
      # the MoE layer (BF16, FP8, v2, v3), the refit (and its kernel-layout conversions), the dense linear; each bounded
      stage moe_layer
      timeout 240 $PY tools/bench_moe_layer.py --iters 10 --tokens 1 8 16 64 256 384 512 768 1024 2048 4096 --kernels v3 \
          --json "$OUT/moe_layer.json" 2>&1 | grep -v -i warn | tail -22
      stage refit
      timeout 70 $PY tools/bench_refit.py --num-layers 8 --json "$OUT/refit.json" 2>&1 | grep -v -i warn | tail -40
      stage linear
      timeout 60 $PY tools/bench_w4a4_linear.py --json "$OUT/linear.json" 2>&1 | grep -v -i warn | tail -16 ;;
    kernel-sweep)
      # the v3 tile sweep (`bench_moe_layer.sweep_configs`: candidate tiles by rows per expert)
      stage moe_sweep
      timeout "${SWEEP_S:-400}" $PY tools/bench_moe_layer.py --iters 10 --tokens ${SWEEP_TOKENS:-16 256 512 1024} \
          --kernels v3 --sweep --json "$OUT/moe_sweep.json" 2>&1 | grep -v -i warn | tail -60 ;;
    stability)
      # issue 24: five rows x STABILITY_ITERS GRPO steps on the pretrained preset (two seeds of the naive rows), on a
      # task the SFT warm-up does not solve, all runs at once on the GPU. Detached (setsid) so it outlives this call
      # while the machine is held; `stability-wait` polls it and brings the results and the run logs back.
      stage stability
      mkdir -p "$STUDY"
      OMP_NUM_THREADS=2 setsid nohup $PY tools/paper_rl_stability.py --hf-checkpoint "$CKPT" --task "${RL_TASK:-sort:10}" \
          --seq-length 32 --max-new-tokens 12 --sft-iters 30 "${STUDY_RUNS[@]}" --jobs 7 --work-dir "$STUDY" \
          --save-interval 0 --out-json "$STUDY/rl_stability.json" --out-png "$STUDY/rl_stability.png" -- \
          --train-iters "${STABILITY_ITERS:-300}" --sft-batch-size 64 --sft-lr 3e-4 --rollout-batch-size 16 \
          --n-samples-per-prompt 8 --eval-interval 25 --lr 2e-5 > "$STUDY/tool.log" 2>&1 < /dev/null &
      sleep 60; tail -3 "$STUDY/tool.log" ;;
    stability-wait)
      stage stability-wait
      end=$((SECONDS + ${WAIT_S:-540}))
      while [ $SECONDS -lt $end ] && ! grep -q "^wrote" "$STUDY/tool.log"; do sleep 15; done
      for f in "$STUDY"/*seed*.log; do echo "$(basename "$f"): $(grep -E '^step ' "$f" | tail -1)"; done
      if grep -q "^wrote" "$STUDY/tool.log"; then
        grep -E "^\||^wrote" "$STUDY/tool.log"
        cp "$STUDY"/rl_stability.json "$STUDY"/rl_stability.png "$OUT"/
      else  # still running (or cut): the plot and table so far, unfinished runs up to their last logged step
        tail -2 "$STUDY/tool.log"
        $PY tools/paper_rl_stability.py "${STUDY_RUNS[@]}" --work-dir "$STUDY" --plot-only \
            --out-json "$OUT/rl_stability_partial.json" --out-png "$OUT/rl_stability_partial.png" 2>&1 | grep -E "^\||^wrote|rror"
      fi
      # the run logs, records and TensorBoard scalars: enough to rebuild the plot if a run did not finish
      tar czf "$OUT/rl_stability_logs.tgz" -C "$STUDY" $(cd "$STUDY" && ls -d *.log *.json */tb 2>/dev/null) ;;
    sglang)
      # SGLang's server with --quantization quads: agreement, weight updates, throughput (SGLANG_ARGS picks)
      stage sglang
      with_sglang || exit 1
      # one MoE layer's update through the quads loaders: per expert vs whole-layer tensors (load / process ms)
      [ "${PLUGIN_BENCH:-1}" = 1 ] && { $PY tools/bench_sglang_plugin.py --update-only 2>&1 | grep -v -i warn | tail -4 \
          || echo "bench_sglang_plugin failed"; }
      $PY tools/sglang_h200.py --out-json "$OUT/sglang.json" ${SGLANG_ARGS:-} ;;
    sglang-grpo|grpo)
      # the main job on the pretrained preset with routing replay: SGLang rollouts (--sglang-launch, its
      # routed-experts capture) or the local engine, same flags, for the side-by-side record
      stage "$s"
      extra=()
      if [ "$s" = sglang-grpo ]; then
        with_sglang || exit 1
        slim=$($PY -c 'from quads_megatron.rl.engines.sglang_launch import SLIM_IMAGE_ARGS as a; print(" ".join(a))')
        # prefill graphs off: SGLang captures 58 token counts up to 8192 by default, the first took 31 s on the H100
        # (the call's limit ran out in the capture); rollouts are decode-bound and decode graphs stay on, up to the
        # rollout batch (16 prompts x 8 samples)
        extra=(--sglang-launch --sglang-server-args "$slim --mem-fraction-static 0.3 --disable-prefill-cuda-graph
              --cuda-graph-max-bs-decode 128")
      fi
      torchrun --nproc-per-node 1 examples/train_grpo_moe.sh --hf-checkpoint "$CKPT" --bf16 --seq-length 48 \
          --max-new-tokens 16 --train-iters "$RL_ITERS" "${RL_FLAGS[@]}" --use-rollout-routing-replay "${extra[@]}" \
          --tensorboard-dir "$OUT/tb-$s" --summary-json "$OUT/$s.json" --no-progress 2>&1 \
          | grep -E "summary|step .*0 \||Error|error" | tail -12 ;;
    *) echo "unknown stage $s (check, check-rl, pretrain, ablations, rl, kernels, stability, stability-wait, sglang, sglang-grpo, grpo)"; exit 2 ;;
  esac
done
stage done

#!/usr/bin/env bash
# The first check of jaxrl on an accelerator, in under 10 minutes on one GPU:
#   1. `jaxrl bench sample` at Qwen3-4B's shapes (random NF4 weights), batches 1, 8 and 32,
#      128 prompt and 128 new tokens;
#   2. `jaxrl bench step` at the shapes of configs/cedar_qwen3_4b_1gpu.yaml (random weights),
#      on a GPU of more than 32 GB with XLA's memory capped at what a 32 GB card gives it;
#   3. where a decode step's time goes: `jaxrl bench sample --profile` at batch 32, 16 new tokens
#      (the device's time by program and operation; the trace stays in OUT_DIR/profile);
#   4. the tests that run jax programs an accelerator runs (`pytest -m accelerator`: HF parity,
#      NF4 dequantization, the one-dense-layer-at-a-time memory bounds), float32 matmuls at
#      full precision (the parity tolerance is 1e-5; TF32 would not meet it);
#   5. the quickstart as shipped (`jaxrl train`, the embedded default model).
# The figures come first, so that a check cut short still has them.
# Each step's output goes to OUT_DIR/<step>.log and the bench figures to OUT_DIR/bench.jsonl;
# a failed step is reported and the others still run. Exit status 1 if any step failed.
#
#   tools/accelerator_check.sh [--tiny] [OUT_DIR]
#
# Without an accelerator (jax's default backend is the CPU), or with --tiny, it runs its tiny
# form: the same commands on a 2-layer architecture with a few tokens, the quickstart for one
# step of 8 tokens, and the accelerator tests only collected (the whole suite runs them on the
# CPU). CI runs the tiny form so that this script cannot rot, in a venv with only
# `pip install -e .` (there the tiny form only says that the tests need the test extra).
set -uo pipefail
cd "$(dirname "$0")/.."

tiny=0
if [ "${1:-}" = "--tiny" ]; then
  tiny=1
  shift
fi
out="${1:-accelerator-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out" || exit 1
out="$(cd "$out" && pwd)"

backend="$(python -c 'import jax; print(jax.default_backend())')" || exit 1
if [ "$backend" = cpu ]; then
  tiny=1
fi
echo "accelerator check: backend $backend, $([ $tiny = 1 ] && echo tiny || echo full) form, output in $out"

jaxrl() {  # the checkout this script is in, whichever jaxrl is installed
  python -m jaxrl.cli "$@"
}

failed=()
run_step() {  # run_step NAME COMMAND...: runs it, logs to $out/NAME.log, records a failure
  local name=$1 start=$SECONDS
  shift
  echo "== $name: $*"
  if "$@" > "$out/$name.log" 2>&1; then
    echo "== $name: ok in $((SECONDS - start)) s"
  else
    echo "== $name: FAILED after $((SECONDS - start)) s; last lines of $out/$name.log:"
    tail -n 20 "$out/$name.log"
    failed+=("$name")
  fi
  tail -n 12 "$out/$name.log" | grep '^|' || true
}

collect_accelerator_tests() {  # the tiny form: the selection exists and imports
  local count
  if ! python -c 'import pytest' 2>/dev/null; then  # a bare install (CI's first section)
    echo "pytest is not installed (pip install -e '.[test]'); the whole suite runs these tests"
    return 0
  fi
  count=$(python -m pytest -q -m accelerator --collect-only 2>&1 | grep -c '::') || true
  echo "$count accelerator tests collected"
  [ "$count" -gt 0 ]
}

if [ $tiny = 1 ]; then
  model="$out/tiny-model"
  mkdir -p "$model"
  cat > "$model/config.json" <<'EOF'
{"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "eos_token_id": 2, "tie_word_embeddings": true}
EOF
  run_step bench_sample jaxrl bench sample --batches 1,2 --prompt-tokens 16 \
    --out "$out/bench.jsonl" "model.path=$model" sampling.max_new_tokens=8
  run_step bench_step jaxrl bench step --config configs/cedar_qwen3_4b_1gpu.yaml --steps 1 \
    --prompt-tokens 16 --out "$out/bench.jsonl" "model.path=$model" \
    data.max_prompt_tokens=16 sampling.max_new_tokens=8
  run_step profile jaxrl bench sample --batches 2 --prompt-tokens 16 --repeats 1 \
    --profile "$out/profile" "model.path=$model" sampling.max_new_tokens=8
  run_step tests collect_accelerator_tests
  run_step quickstart jaxrl train run.steps=1 sampling.max_new_tokens=8 \
    "run.output_dir=$out/quickstart"
else
  run_step bench_sample jaxrl bench sample --batches 1,8,32 --prompt-tokens 128 \
    --out "$out/bench.jsonl" model.path=qwen3-4b sampling.max_new_tokens=128
  # the CEDAR recipe promises one 32 GB GPU: on a larger NVIDIA card, XLA gets what it would get
  # on a 32 GB one at launch/single_gpu.sh's XLA_CLIENT_MEM_FRACTION=0.90 (28.8 GiB)
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  cap=()
  if [ "${mib:-0}" -gt 32768 ] 2>/dev/null; then
    # jax refuses the deprecated XLA_PYTHON_CLIENT_MEM_FRACTION beside XLA_CLIENT_MEM_FRACTION
    cap=(env -u XLA_PYTHON_CLIENT_MEM_FRACTION
         "XLA_CLIENT_MEM_FRACTION=$(python -c "print(round(0.9 * 32768 / $mib, 4))")")
    echo "bench_step: XLA's memory capped at 28.8 GiB of this card's $mib MiB (${cap[3]})"
  fi
  run_step bench_step "${cap[@]}" python -m jaxrl.cli bench step \
    --config configs/cedar_qwen3_4b_1gpu.yaml --steps 1 --out "$out/bench.jsonl" model.path=qwen3-4b
  run_step profile jaxrl bench sample --batches 32 --prompt-tokens 128 --repeats 1 \
    --profile "$out/profile" model.path=qwen3-4b sampling.max_new_tokens=16
  run_step tests env JAX_PLATFORMS= JAX_DEFAULT_MATMUL_PRECISION=highest \
    python -m pytest -q -m accelerator -p no:cacheprovider
  run_step quickstart jaxrl train "run.output_dir=$out/quickstart"
fi

if [ ! -s "$out/quickstart/metrics.jsonl" ]; then
  echo "accelerator check: the quickstart wrote no metrics.jsonl in $out/quickstart" >&2
  failed+=("quickstart-metrics")
fi
if [ "${#failed[@]}" -gt 0 ]; then
  echo "accelerator check: FAILED: ${failed[*]} (logs in $out)" >&2
  exit 1
fi
echo "accelerator check: all steps passed; figures in $out/bench.jsonl, logs in $out"

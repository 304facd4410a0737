#!/usr/bin/env bash
# The accelerator check of jaxrl, old decode forms against new in one run, in under 8 minutes on
# one H100 or H200:
#   1. `jaxrl bench decode` at Qwen3-4B's shapes (random NF4 weights, LoRA r16): batches 1, 8, 32
#      and 64, capacities 2,048 and 8,192 columns half full, 16 steps a call, the forms taking
#      turns: block and split (the XLA NF4 forms over XLA attention, the chunk stopping early),
#      kernels (the Pallas NF4 and attention kernels, a fixed chunk; where this tree's numerics
#      has them) and dense (the platform's numerics, NF4 dequantized once), each program's
#      structural counts beside its figures; a case whose cache does not fit is skipped;
#   2. `jaxrl bench step` at the shapes of configs/cedar_qwen3_4b_1gpu.yaml (random weights),
#      on a GPU of more than 32 GB with XLA's memory capped at what a 32 GB card gives it;
#   3. a profile of a batch-32 chunk of each form (device events per layer and step, the idle
#      share of the call; traces in OUT_DIR/profile);
#   4. the decode program's structure lowered for the CPU and, from the same host, CUDA
#      (tools/decode_structure.py: dots and custom calls per layer, loops, conditionals, host
#      transfers);
#   5. OUT_DIR/accelerator_check.json and accelerator_check.md: the figures as one JSON file and
#      as Markdown tables (device, jax version, command per row, ms/step, share of peak HBM
#      bandwidth by the bytes a step must move) that docs/benchmarks.md can take as they are;
#   6. the tests that run jax programs an accelerator runs (`pytest -m accelerator`), float32
#      matmuls at full precision (the parity tolerance is 1e-5; TF32 would not meet it);
#   7. the quickstart as shipped (`jaxrl train`, the embedded default model).
# The figures come first, so that a check cut short still has them.
# Each step's output goes to OUT_DIR/<step>.log and its command to OUT_DIR/commands.tsv; a failed
# step is reported and the others still run. Exit status 1 if any step failed.
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
python -c 'import jax, jaxlib; print(f"jax {jax.__version__}, jaxlib {jaxlib.__version__},",
                                      f"devices: {jax.devices()}")' || exit 1
: > "$out/commands.tsv"

jaxrl() {  # the checkout this script is in, whichever jaxrl is installed
  python -m jaxrl.cli "$@"
}

failed=()
run_step() {  # run_step NAME COMMAND...: runs it, logs to $out/NAME.log, records a failure
  local name=$1 start=$SECONDS
  shift
  echo "== $name: $*"
  printf '%s\t%s\n' "$name" "$*" >> "$out/commands.tsv"
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

forms=block,split,kernels,dense
report() {  # the figures so far as OUT_DIR/accelerator_check.{json,md}
  python -c 'import sys; from jaxrl.bench.decode_forms import write_check_report
write_check_report(sys.argv[1])' "$out"
}

if [ $tiny = 1 ]; then
  model="$out/tiny-model"
  mkdir -p "$model"
  cat > "$model/config.json" <<'EOF'
{"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "eos_token_id": 2, "tie_word_embeddings": true}
EOF
  run_step bench_decode jaxrl bench decode --batches 1,4 --capacities 64 --steps 4 --repeats 1 \
    --forms "$forms" --structure --out "$out/decode.jsonl" "model.path=$model" lora.rank=4
  run_step bench_step jaxrl bench step --config configs/cedar_qwen3_4b_1gpu.yaml --steps 1 \
    --prompt-tokens 16 --out "$out/step.jsonl" "model.path=$model" \
    data.max_prompt_tokens=16 sampling.max_new_tokens=8
  run_step profile jaxrl bench decode --batches 4 --capacities 64 --steps 4 --repeats 1 \
    --forms split,dense --profile "$out/profile" --out "$out/profile.jsonl" "model.path=$model" \
    lora.rank=4
  run_step structure env JAX_PLATFORMS=cpu python tools/decode_structure.py --model "$model" \
    --targets cpu,cuda --forms "$forms" --slots 4 --capacity 64 --lora-rank 4 --steps 4 \
    --out "$out/structure.json"
  run_step report report
  run_step tests collect_accelerator_tests
  run_step quickstart jaxrl train run.steps=1 sampling.max_new_tokens=8 \
    "run.output_dir=$out/quickstart"
else
  # XLA's allocator takes 90% of the card (launch/single_gpu.sh's share) for the decode cases
  mem=(env -u XLA_PYTHON_CLIENT_MEM_FRACTION XLA_CLIENT_MEM_FRACTION=0.90)
  run_step bench_decode "${mem[@]}" python -m jaxrl.cli bench decode --batches 1,8,32,64 \
    --capacities 2048,8192 --fill 0.5 --steps 16 --repeats 3 --forms "$forms" --structure \
    --out "$out/decode.jsonl" model.path=qwen3-4b lora.rank=16
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
    --config configs/cedar_qwen3_4b_1gpu.yaml --steps 1 --out "$out/step.jsonl" model.path=qwen3-4b
  # its programs come from the persistent compilation cache the decode bench filled
  run_step profile "${mem[@]}" python -m jaxrl.cli bench decode --batches 32 --capacities 2048 \
    --fill 0.5 --steps 16 --repeats 1 --forms "$forms" --profile "$out/profile" \
    --out "$out/profile.jsonl" model.path=qwen3-4b lora.rank=16
  run_step structure env JAX_PLATFORMS=cpu python tools/decode_structure.py --targets cpu,cuda \
    --forms "$forms" --slots 32 --capacity 2048 --out "$out/structure.json"
  run_step report report
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
echo "accelerator check: all steps passed; figures in $out/accelerator_check.md and .json," \
  "logs in $out"

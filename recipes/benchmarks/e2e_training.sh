#!/usr/bin/env bash
# End to end on the embedded model, CPU: collect Jacobi trajectories on training prompts, train with the
# CLLM and the Jacobi Forcing recipes, then measure on the held-out prompts: TPF / tokens per second of
# jacobi and jacobi_forcing before (base) and after (each trained checkpoint), held-out loss and
# agreement with the base model. Every step resumes or skips when its output exists; about 1 hour on
# 2 cores. Run from the repository root after `bash scripts/setup.sh`; figures in docs/training.md.
set -euo pipefail
OUT=${OUT:-runs/e2e}
THREADS=${THREADS:-2}
STEPS=${STEPS:-200}
TRAJ=${TRAJ:-$OUT/traj16}          # reuse a collection from another run with TRAJ=...
TRAIN_ARGS=${TRAIN_ARGS:-}         # extra recipe overrides, e.g. TRAIN_ARGS="--learning_rate 1e-4"
export OMP_NUM_THREADS=$THREADS
mkdir -p "$OUT"

# 1. 1603 training prompts (function openings of the stdlib training split, 4 per file) -> trajectories
[ -f "$OUT/train_prompts.jsonl" ] || python recipes/demo_model/make_prompts.py --split train --num_prompts 1600 \
  --per_file 4 --out "$OUT/train_prompts.jsonl"
hf-paralleldecode collect --model default --prompts "$OUT/train_prompts.jsonl" --output-dir "$TRAJ" \
  --block-size 16 --max-new-tokens 96 --batch-size 16 --threads "$THREADS"

# 2. the two recipes, one epoch each (200 steps x 8 rows)
for method in jacobi_forcing cllm; do
  [ -f "$OUT/$method/model.safetensors" ] || hf-paralleldecode train --config "recipes/${method}_tiny_cpu.yaml" \
    --trajectories "$TRAJ" --output_dir "$OUT/$method" --max_steps "$STEPS" --save_steps 100 $TRAIN_ARGS
done

# 3. quality: held-out loss, greedy and teacher-forced agreement with the base model
python recipes/demo_model/evaluate_trained.py "$OUT/jacobi_forcing" "$OUT/cllm" --num-prompts 32 \
  | tee "$OUT/quality.json"

# 4. speed before / after, same prompts and settings, AR in the same run as the baseline of each model
STRATS="jacobi:block_size=16 jacobi_forcing:block_size=16,num_blocks=2,pool_size=4 jacobi_forcing"
for model in default "$OUT/jacobi_forcing" "$OUT/cllm"; do
  name=$(basename "$model")
  hf-paralleldecode bench --model "$model" --num-prompts 16 --max-new-tokens 96 --repeats 1 --threads "$THREADS" \
    --strategies $STRATS --output-dir "$OUT/bench_$name" | tee "$OUT/bench_$name.txt"
done

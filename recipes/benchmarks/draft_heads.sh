#!/usr/bin/env bash
# Draft heads on the embedded model: tau and tokens/s against the tree budget, with transformers'
# prompt lookup, transformers' own DFlash path (the exported head) and AR in the same run, at batch 1, 4 and 8;
# the FKL / RKL / corpus-text ablation heads; the speed-up formula. Run from the repository root.
# Each bench block writes bench.json, bench.png and tree_budget.png under $OUT.
set -euo pipefail
OUT=${OUT:-bench_out/draft_heads}
THREADS=${THREADS:-2}
PROMPTS=${PROMPTS:-16}
NEW=${NEW:-64}
REPEATS=${REPEATS:-1}
JET=${JET:-default-jetspec}
DFL=${DFL:-default-dflash}

for batch in ${BATCHES:-1 4 8}; do
  # every budget at batch 1; three at larger batches (each budget costs a full pass over the prompts)
  if [[ $batch == 1 ]]; then budgets=${BUDGETS:-16 32 64 128 256}; else budgets=${BATCH_BUDGETS:-16 64 256}; fi
  strategies=()
  for b in $budgets; do strategies+=("speculative:drafter=$JET,tree_budget=$b"); done
  if [[ $batch == 1 ]]; then  # the causal head with 4x the default waves (tree_waves = 4 x its depth of 8)
    for b in $budgets; do strategies+=("speculative:drafter=$JET,tree_budget=$b,tree_waves=32"); done
  fi
  for b in $budgets; do strategies+=("speculative:drafter=$DFL,tree_budget=$b"); done
  strategies+=("speculative:drafter=$DFL,tree_budget=8,tree_width=1" "dflash_transformers:drafter=$DFL" transformers_prompt_lookup)
  hf-paralleldecode bench --model default --num-prompts "$PROMPTS" --max-new-tokens "$NEW" --repeats "$REPEATS" \
    --threads "$THREADS" --batch-size "$batch" --strategies "${strategies[@]}" --output-dir "$OUT/batch$batch"
done

# the Jacobi Forcing checkpoint's TPF on the same prompts (its own model: the heads draft for the base model)
hf-paralleldecode bench --model default-trained --num-prompts "$PROMPTS" --max-new-tokens "$NEW" --repeats 1 \
  --threads "$THREADS" --strategies jacobi_forcing transformers_prompt_lookup --output-dir "$OUT/jacobi_forcing"

# ablations (JetSpec Table 4 / Table 6), heads trained by recipes/draft_head_tiny_cpu.yaml with
#   --objective reverse_kl  and  --trajectories runs/dh/regen_text (regenerate --response-column continuation)
if [[ -n "${ABLATION_HEADS:-}" ]]; then
  ablation=()
  for h in $JET $ABLATION_HEADS; do
    ablation+=("speculative:drafter=$h,tree_budget=4,tree_depth=4,tree_width=1" "speculative:drafter=$h,tree_budget=64")
  done
  hf-paralleldecode bench --model default --num-prompts "$PROMPTS" --max-new-tokens "$NEW" --repeats 1 \
    --threads "$THREADS" --strategies "${ablation[@]}" transformers_prompt_lookup --output-dir "$OUT/ablation"
fi

python recipes/benchmarks/speedup_formula.py --threads "$THREADS" --num-prompts "$PROMPTS" --max-new-tokens "$NEW" \
  --heads "$JET" "$DFL" --budgets 16 64 256 --output "$OUT/speedup_formula.json"

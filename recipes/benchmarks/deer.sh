#!/usr/bin/env bash
# DEER on the embedded base model, held-out prompts, batch 1, in ONE run per prompt set: the shipped
# aligned drafter (stage I + II) at block sizes 4 / 8 / 16 / 32, the same drafter before alignment
# (stage 0: masked-diffusion pretraining only) and after stage I only, the draft heads, DEER composed
# with context n-grams, transformers' prompt lookup and AR. Then the tables and the acceptance-by-depth
# chart (recipes/benchmarks/deer_tables.py). Run from the repository root after
# recipes/deer/train_default_deer.py (its stage folders are STAGES/stage0, stage1).
set -euo pipefail
OUT=${OUT:-bench_out/deer}
THREADS=${THREADS:-2}
PROMPTS=${PROMPTS:-16}
NEW=${NEW:-64}
REPEATS=${REPEATS:-2}
STAGES=${STAGES:-runs/deer}
DEER=${DEER:-default-deer}

strategies=()
for k in 4 8 16 32; do
  strategies+=("speculative:drafter=$DEER,tree_depth=$k,tree_width=1")
done
for k in ${STAGE_DEPTHS:-4 8 16}; do
  strategies+=("speculative:drafter=$STAGES/stage0,tree_depth=$k,tree_width=1"
               "speculative:drafter=$STAGES/stage1,tree_depth=$k,tree_width=1")
done
# denoise_steps=2 (a second forward refines the block); the cost of a drafter without a prefix cache: the stage-0
# weights wrapped as attention=bidirectional (a copy of the folder with that setting): its acceptance means
# nothing (trained block-causal), its drafter_tokens_per_forward and seconds are what no cache costs
strategies+=("speculative:drafter=$DEER,tree_depth=8,tree_width=1,denoise_steps=2")
if [[ -d $STAGES/costprobe_bidirectional ]]; then
  strategies+=("speculative:drafter=$STAGES/costprobe_bidirectional,tree_depth=8,tree_width=1")
fi
strategies+=("speculative:drafter=$DEER,tree_depth=8,tree_width=4,tree_budget=16"
             "speculative:drafter=$DEER,tree_depth=8,tree_width=1,context_matches=2,context_tokens=6"
             "speculative:drafter=default-jetspec,tree_depth=8,tree_width=1"
             "speculative:drafter=default-jetspec"
             "speculative:drafter=default-dflash"
             prompt_lookup
             transformers_prompt_lookup)
for set in ${SETS:-openings midfile}; do
  if [[ $set == midfile ]]; then prompts=hf_paralleldecode/assets/prompts/stdlib_test_midfile.jsonl
  else prompts=hf_paralleldecode/assets/prompts/stdlib_test.jsonl; fi
  hf-paralleldecode bench --model default --prompts "$prompts" --num-prompts "$PROMPTS" --max-new-tokens "$NEW" \
    --repeats "$REPEATS" --threads "$THREADS" --strategies "${strategies[@]}" --output-dir "$OUT/$set"
  python recipes/benchmarks/deer_tables.py "$OUT/$set/bench.json" --chart "$OUT/$set/acceptance_by_depth.png"
done

#!/usr/bin/env bash
# The measurements of the performance page (docs/benchmark.md): the project's strategies against transformers' prompt lookup decoding, in one run per setting.
# Run from the repository root after `bash scripts/setup.sh`; nothing else should run on the machine meanwhile.
#   1. batch 1, both embedded models, two held-out prompt sets (function openings; mid-file windows). `speculative`
#      with no settings is each checkpoint's own default: DEER with the drafter aligned to that model, composed with
#      context n-grams (parallel_decoding_config.json); the ablations drop the context matches or run the drafter
#      in fp32 instead of the CPU preset's bf16
#   2. batch 1, 4, 8 on the Jacobi Forcing model (transformers' prompt lookup runs row by row at batch > 1)
#   3. host time per step on a tiny random model, batch 1 / 8 / 32
set -euo pipefail
OUT=${OUT:-bench_out/faster_than_prompt_lookup}
THREADS=${THREADS:-2}
P=hf_paralleldecode/assets/prompts
STRATEGIES="transformers_prompt_lookup speculative speculative:context_matches=0 speculative:drafter_dtype=target \
  prompt_lookup jacobi_forcing lookahead"
for MODEL in default default-trained; do
  for SET in stdlib_test stdlib_test_midfile; do
    hf-paralleldecode bench --model $MODEL --prompts $P/$SET.jsonl --num-prompts 16 --max-new-tokens 64 --repeats 3 \
      --threads "$THREADS" --strategies $STRATEGIES --output-dir "$OUT/b1_${MODEL}_${SET}"
  done
done
hf-paralleldecode bench --model default-trained --num-prompts 16 --max-new-tokens 64 --repeats 2 --threads "$THREADS" \
  --batch-sizes 1 4 8 --strategies transformers_prompt_lookup speculative prompt_lookup \
  jacobi_forcing:context_matches=2,pool_size=0,context_tokens=6 --output-dir "$OUT/batch_sizes"
for B in 1 8 32; do
  hf-paralleldecode bench --model random-tiny --num-prompts $(( B < 8 ? 8 : B )) --batch-size $B --max-new-tokens 64 \
    --repeats 3 --threads "$THREADS" --output-dir "$OUT/host_b$B" \
    --strategies jacobi:block_size=16 jacobi_forcing:block_size=64,num_blocks=2,activation_ratio=0.85,pool_size=4 lookahead
done

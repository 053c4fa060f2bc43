#!/usr/bin/env bash
# The CPU figures quoted in the docs: embedded model + a random ~120M model.
# Run from the repository root after `bash scripts/setup.sh`. Each block writes JSON + PNG under bench_out/.
set -euo pipefail
OUT=${OUT:-bench_out}
THREADS=${THREADS:-2}

# 1. Jacobi block sizes on the embedded model (docs/methods/jacobi.md)
hf-paralleldecode bench --model default --num-prompts 8 --max-new-tokens 96 --repeats 3 --threads "$THREADS" \
  --strategies jacobi:block_size=4 jacobi:block_size=16 jacobi:block_size=64 --output-dir "$OUT/jacobi_blocks"

# 2. Loop overhead on a ~120M-parameter random model, block size 16
hf-paralleldecode bench --model random-100m --num-prompts 4 --max-new-tokens 32 --repeats 1 --threads "$THREADS" \
  --strategies jacobi:block_size=16 --output-dir "$OUT/overhead_100m"

# 3. Jacobi Forcing grid (block_size x pool_size), used to choose the CPU defaults
hf-paralleldecode sweep --model default --num-prompts 8 --max-new-tokens 64 --repeats 1 --threads "$THREADS" \
  --decoding jacobi_forcing --grid block_size=4,8,16,32 pool_size=0,2,4,8 --output-dir "$OUT/jf_sweep"

# 4. All strategies side by side, with transformers' prompt lookup decoding as the in-ecosystem peer
hf-paralleldecode bench --model default --num-prompts 8 --max-new-tokens 96 --repeats 3 --threads "$THREADS" \
  --strategies jacobi:block_size=16 jacobi_forcing lookahead prompt_lookup transformers_prompt_lookup --output-dir "$OUT/strategies"

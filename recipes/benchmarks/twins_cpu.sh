#!/usr/bin/env bash
# The realistic-cost tables of the Performance page on a CPU: the 1B cost twins of both embedded models
# (hf_paralleldecode.cost_twin; --model default-1b / default-trained-1b), beside stock (batched) generate and
# transformers' prompt lookup in the same run. Writes docs/assets/twins/cpu/<section>/; render the page with
# `python scripts/render_tables.py` afterwards. About 80 minutes on 2 cores; ONLY="b1 roofline" runs some sections
# (batch64 batch b1 sample fp32 fp32batch roofline sample03 large8m); REP (batch 1, greedy) and REPB (the rest) set the interleaved
# repeats. The bf16 sections need oneDNN's bf16 kernel (a CPU with AVX-512): on an AVX2-only CPU every bf16 bench
# warns at its start and measures torch's slow fallback instead (docs/troubleshooting.md).
#   bash recipes/benchmarks/twins_cpu.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT_DIR:-docs/assets/twins/cpu}; mkdir -p "$OUT"
SHAPE=${SHAPE:-1b}; NB1=${NB1:-8}; NB16=${NB16:-32}; NB=${NB:-64}; TOK=${TOK:-64}; REP=${REP:-2}; REPB=${REPB:-1}
P=hf_paralleldecode/assets/prompts/stdlib_test_midfile.jsonl; P2="$P hf_paralleldecode/assets/prompts/stdlib_test.jsonl"
BENCH="python3 -m hf_paralleldecode.cli bench --threads 2 --max-new-tokens $TOK --trace-steps"  # (every policy step kept)
# the shapes the batch policy chooses from, each run alone (the policy's regret is against the best of them)
TREE="speculative:adaptive=false"
C8="speculative:adaptive=false,tree_width=1,tree_depth=8,tree_budget=8,context_matches=0"
C4="speculative:adaptive=false,tree_width=1,tree_depth=4,tree_budget=4,context_matches=0"
C2="speculative:adaptive=false,tree_width=1,tree_depth=2,tree_budget=2,context_matches=0"
PLAIN="speculative:max_step_tokens=1"  # the library's plain step alone (no speculation): stock's work, our loop
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
run() { local name=$1; shift; echo "=== $name $(date +%T)"; "$@" --output-dir "$OUT/$name" > "$OUT/$name.log" 2>&1
        echo "rc=$? $(date +%T)"; grep -v "Loading\|bench:" "$OUT/$name.log" | tail -n 12; }
for m in default-trained default; do  # the 8.4M models at 16-64 rows beside the shapes the policy chooses from
  want large8m && run "large_$m-8m" $BENCH --model "$m" --prompts $P2 --num-prompts "$NB" --batch-sizes 16 32 64 \
    --repeats "$REP" --strategies speculative $TREE $C8 $C4 $C2 $PLAIN
done
for m in default-trained default; do  # batch 64 on all 64 prompts, 4 and 16 on 32
  want batch64 && run "batch64_$m-$SHAPE" $BENCH --model "$m-$SHAPE" --dtype bfloat16 --prompts $P2 --num-prompts "$NB" \
    --batch-sizes 64 --repeats "$REPB" --strategies speculative $TREE $C4 $C2 $PLAIN
done
for m in default-trained default; do
  want batch && run "batch_$m-$SHAPE" $BENCH --model "$m-$SHAPE" --dtype bfloat16 --prompts $P2 --num-prompts "$NB16" \
    --batch-sizes 4 16 --repeats "$REPB" --strategies speculative $TREE $C4 $C2
done
for m in default-trained default; do
  want b1 && run "b1_$m-$SHAPE" $BENCH --model "$m-$SHAPE" --dtype bfloat16 --prompts $P --num-prompts "$NB1" \
    --batch-sizes 1 --repeats "$REP" --strategies speculative $TREE $C8 $C4 transformers_prompt_lookup
done
for m in default-trained default; do  # the 8.4M models themselves on the same prompts: their tokens per forward
  want b1 && run "b1_$m-8m" $BENCH --model "$m" --prompts $P --num-prompts "$NB1" --batch-sizes 1 --repeats "$REP" \
    --strategies speculative $TREE
done
for m in default-trained default; do
  want sample && run "sample_t0.8_$m-$SHAPE" $BENCH --model "$m-$SHAPE" --dtype bfloat16 --prompts $P \
    --num-prompts "$NB1" --batch-sizes 1 --repeats "$REPB" --do-sample --temperature 0.8 \
    --strategies speculative transformers_prompt_lookup
done
if want roofline; then
  for m in default default-$SHAPE; do for dt in bfloat16 float32; do
    echo "=== roofline $m $dt $(date +%T)"
    python3 scripts/gpu_roofline.py --model "$m" --dtype $dt --device cpu --threads 2 --repeats 3 --max-fed 256 \
      --output "$OUT/roofline_${m}_$dt.json" > "$OUT/roofline_${m}_$dt.log" 2>&1; echo "rc=$?"
  done; done
  python3 scripts/gpu_roofline.py --plot "$OUT"/roofline_default-"$SHAPE"_bfloat16.json "$OUT"/roofline_default-"$SHAPE"_float32.json \
    "$OUT"/roofline_default_float32.json --output "$OUT/roofline.png"
fi
# fp32: batch 1 and sampling on both models, 16 rows on the JF model (its tree is left out there: 16 x 21 tokens a
# forward); on 2 cores of an AVX2-only CPU about 75 minutes (docs/assets/twins/cpu/fp32/)
if want fp32; then
  mkdir -p "$OUT/fp32"
  for m in default-trained default; do
    run "fp32/b1_$m-$SHAPE" $BENCH --model "$m-$SHAPE" --dtype float32 --prompts $P2 --num-prompts "$NB1" \
      --batch-sizes 1 --repeats "$REPB" --strategies speculative $TREE $C4 transformers_prompt_lookup
    run "fp32/sample_t0.8_$m-$SHAPE" $BENCH --model "$m-$SHAPE" --dtype float32 --prompts $P2 --num-prompts "$NB1" \
      --batch-sizes 1 --repeats "$REPB" --do-sample --temperature 0.8 --strategies speculative transformers_prompt_lookup
  done
  run "fp32/b16_default-trained-$SHAPE" $BENCH --model "default-trained-$SHAPE" --dtype float32 --prompts $P2 \
    --num-prompts 16 --batch-sizes 16 --repeats "$REPB" --strategies speculative $C4 $C2 $PLAIN
fi
# fp32 at 4 and 64 rows on the JF model: the policy against the shapes it chooses from, each run alone (the tree
# only at 4 rows); on 2 cores of an AVX2-only CPU about 100 minutes, most of it the 64-row cell (its untimed warm-up
# alone prefills 64 x ~100 fp32 tokens once per entry). MODELS="default-trained default" adds the base model, with
# its 16-row cell (the JF model's is in section fp32; about 40 minutes more)
if want fp32batch; then
  mkdir -p "$OUT/fp32"
  for m in ${MODELS:-default-trained}; do
    [ "$m" = default-trained ] || run "fp32/b16_$m-$SHAPE" $BENCH --model "$m-$SHAPE" --dtype float32 --prompts $P2 \
      --num-prompts 16 --batch-sizes 16 --repeats "$REPB" --strategies speculative $C4 $C2 $PLAIN
    run "fp32/b64_$m-$SHAPE" $BENCH --model "$m-$SHAPE" --dtype float32 --prompts $P2 --num-prompts 64 \
      --batch-sizes 64 --repeats "$REPB" --strategies speculative $C4 $C2 $PLAIN
    run "fp32/b4_$m-$SHAPE" $BENCH --model "$m-$SHAPE" --dtype float32 --prompts $P2 --num-prompts "$NB1" \
      --batch-sizes 4 --repeats "$REPB" --strategies speculative $TREE $C4 $C2
  done
fi
for m in default-trained default; do
  want sample03 && run "sample_t0.3_$m-$SHAPE" $BENCH --model "$m-$SHAPE" --dtype bfloat16 --prompts $P \
    --num-prompts "$NB1" --batch-sizes 1 --repeats "$REPB" --do-sample --temperature 0.3 \
    --strategies speculative transformers_prompt_lookup
done
echo "done $(date +%T)"

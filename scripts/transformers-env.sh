#!/usr/bin/env bash
# The equivalence core on another transformers release, in its own virtual environment.
#   bash scripts/transformers-env.sh                           # the floor of the tested range (what .ci/run checks)
#   TRANSFORMERS_VERSION=5.25.0 bash scripts/transformers-env.sh   # any release, e.g. a new one before the range admits it
#   ... -- -k speculative                                       # extra pytest arguments after --
# The environment (.venvs/transformers-<version>) sees this machine's packages (torch, trl, ...) and holds its own
# transformers, installed by scripts/setup.sh; it is reused by the next run. The core is every test marked `core`
# (greedy tables of every strategy, the sampling chi-square tests, the robustness tables; pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/^TESTED_TRANSFORMERS = ("\([0-9.]*\)".*/\1/p' hf_paralleldecode/compat.py)
version=${TRANSFORMERS_VERSION:-$floor}
venv=.venvs/transformers-$version
base=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  echo "[transformers-env] creating $venv" >&2
  "$base" -m venv --system-site-packages "$venv"
fi
PYTHON="$venv/bin/python" TRANSFORMERS_VERSION="$version" bash scripts/setup.sh dev
[ "${1:-}" = "--" ] && shift
echo "[transformers-env] equivalence core on transformers $version" >&2
exec "$venv/bin/python" -m pytest -q -m core -p no:cacheprovider "$@"

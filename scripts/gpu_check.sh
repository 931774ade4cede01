#!/usr/bin/env bash
# The GPU check for a lent CUDA machine: finds a Python whose torch sees the GPU, installs what it
# lacks from carried wheels (nothing can be downloaded there), makes `kvfence` importable, and runs
# scripts/gpu_check.py, which prints one summary. Arguments go to gpu_check.py (--dry-run: on the
# CPU under the Triton interpreter, to prove the script here).
#
#   scripts/gpu_check.sh [--wheels DIR] [gpu_check.py options]   (DIR default: build/gpu-wheels)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS="$ROOT/build/gpu-wheels"
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
DRY_RUN=0
for a in "${ARGS[@]+"${ARGS[@]}"}"; do [ "$a" = "--dry-run" ] && DRY_RUN=1; done
log() { printf '[gpu_check] %s\n' "$*" >&2; }

# The project's venv holds a CPU torch here; on the GPU machine the image's python3 holds a CUDA one.
PY=""
for candidate in "$ROOT/.venv/bin/python" python3; do
  command -v "$candidate" >/dev/null 2>&1 || continue
  if [ "$DRY_RUN" = 1 ] || "$candidate" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    PY="$candidate"; break
  fi
done
[ -n "$PY" ] || { log "no Python with a CUDA-enabled torch found"; exit 2; }
log "python: $PY"

# kvfence's own dependencies and the check's, by import name=distribution name.
NEEDED="triton=triton gguf=gguf msgspec=msgspec starlette=starlette hypercorn=hypercorn anyio=anyio \
httpx=httpx tokenizers=tokenizers jinja2=jinja2 safetensors=safetensors xxhash=xxhash \
prometheus_client=prometheus-client tqdm=tqdm numpy=numpy pytest=pytest"
missing=()
for pair in $NEEDED; do
  "$PY" -c "import ${pair%%=*}" 2>/dev/null || missing+=("${pair#*=}")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "missing: ${missing[*]}"
  SITE=/tmp/kvfence-gpu-site
  if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl >/dev/null 2>&1 || log "installing the wheels in $WHEELS failed"
  else
    # Where a registry is reachable (not on the lent machines), fetch them instead.
    "$PY" -m pip install -q --target "$SITE" "${missing[@]}" >/dev/null 2>&1 \
      || log "no wheels in $WHEELS and no registry: the sections needing ${missing[*]} will fail"
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

# The repository's top-level folders are the subpackages of the `kvfence` namespace (pyproject).
if ! "$PY" -c "import kvfence.engine.attention" 2>/dev/null; then
  NS=/tmp/kvfence-gpu-src
  mkdir -p "$NS/kvfence"
  for pkg in app engine scheduler transports kernels; do ln -sfn "$ROOT/$pkg" "$NS/kvfence/$pkg"; done
  export PYTHONPATH="$NS${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c "import kvfence.engine.attention" || log "kvfence does not import; the sections will fail"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
# gpu_check.py time-boxes every section; this bounds the whole run if one hangs anyway.
exec timeout 420 "$PY" "$ROOT/scripts/gpu_check.py" "${ARGS[@]+"${ARGS[@]}"}"

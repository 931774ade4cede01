# Shared set-up for scripts/serve and scripts/test (sourced, not run): a .venv with kvfence and its
# test tools installed, and the default model in the cache. Idempotent; a second run takes seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$PY" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# torch first and pinned: a bare `torch` requirement can pull a multi-GB CUDA build, while 2.13.0
# resolves to the CPU wheel on machines that carry it locally.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  log "installing torch"
  pip_install "torch==${KVFENCE_TORCH_VERSION:-2.13.0}"
fi

STAMP="$VENV/.kvfence-install-stamp"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  log "installing kvfence and its test tools"
  pip_install -e "$ROOT[test]"
  echo "$WANT" > "$STAMP"
fi

export KVFENCE_HOME="${KVFENCE_HOME:-$HOME/.cache/kvfence}"
"$VENV/bin/kvfence" fetch >/dev/null

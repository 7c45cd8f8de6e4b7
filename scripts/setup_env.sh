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

# torch: keep an existing >=2.11 install, else the 2.13.0 CPU wheel (found on disk through pip's
# find-links; a bare `pip install torch` would pull several GB of CUDA packages).
if ! "$VENV/bin/python" -c "import torch,sys; v=tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 11))" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU)"
  pip install -q torch==2.13.0 2>&1 | quiet
fi
if ! "$VENV/bin/python" -c "import triton" 2>/dev/null; then
  echo "[setup] installing triton==3.6.0"
  # numpy<2.3: the triton 3.6 interpreter breaks on range(tl.cdiv(...)) with numpy 2.4.
  pip install -q triton==3.6.0 "numpy<2.3" 2>&1 | quiet
fi
"$VENV/bin/python" -c "import numpy" 2>/dev/null || pip install -q "numpy<2.3" 2>&1 | quiet
if [ $want_test = 1 ]; then
  "$VENV/bin/python" -c "import pytest, xdist, expecttest, hypothesis" 2>/dev/null || {
    echo "[setup] installing test tools"; pip install -q pytest pytest-xdist expecttest hypothesis 2>&1 | quiet; }
  # fbgemm is optional for users; the fbgemm spelling tests use it when it imports.
  "$VENV/bin/python" -c "import fbgemm_gpu" 2>/dev/null || {
    echo "[setup] installing fbgemm-gpu-cpu==1.8.0"
    pip install -q --no-deps fbgemm-gpu-cpu==1.8.0 2>&1 | quiet || echo "[setup] fbgemm unavailable; its tests will skip"; }
fi
# Editable install registers the torch_dynamo_backends entry point ("hstu").
pip install -q --no-deps --no-build-isolation -e . 2>&1 | quiet
echo "[setup] ready: $("$VENV/bin/python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"

#!/usr/bin/env bash
# Create ./.venv with everything hstu-inductor needs on a fresh machine (CPU, no GPU).
# Usage: scripts/setup_env.sh [--test | --examples]
#   --test adds pytest, pytest-xdist, expecttest, hypothesis, tqdm, fbgemm;
#   --examples adds the examples' optional extras tqdm and matplotlib (about 5 s from a local index; if
#   they cannot be installed, e.g. offline, the examples log progress and the loss summary instead).
# Every `make test` runs this: on a ready .venv it is one Python probe (a few seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
want_test=0; [ "${1:-}" = "--test" ] && want_test=1
want_examples=0; [ "${1:-}" = "--examples" ] && want_examples=1

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
quiet() { grep -v -e "is ignored: it is neither" -e "^$" || true; }

# One probe (importing torch once) names what is missing: torch (>=2.11), triton, numpy, z3, the test
# tools, fbgemm, and the editable install of this checkout (its "hstu" and "hstu_eager"
# torch_dynamo_backends entry points).
missing=$("$VENV/bin/python" - <<'PROBE' 2>/dev/null || echo "torch triton numpy z3 tools extras fbgemm editable"
import importlib.util as u, os, sys
out = []
try:
    import torch
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11):
        out.append("torch")
except ImportError:
    out.append("torch")
out += [m for m in ("triton", "numpy", "z3") if u.find_spec(m) is None]
if any(u.find_spec(m) is None for m in ("pytest", "xdist", "expecttest", "hypothesis", "tqdm")):
    out.append("tools")
if any(u.find_spec(m) is None for m in ("tqdm", "matplotlib")):
    out.append("extras")
try:
    import fbgemm_gpu  # noqa: F401
except Exception:
    out.append("fbgemm")
from importlib.metadata import entry_points
spec = u.find_spec("hstu_inductor")
here = spec is not None and os.path.dirname(os.path.dirname(spec.origin)) == os.getcwd()
if not (here and {"hstu", "hstu_eager"} <= {e.name for e in entry_points(group="torch_dynamo_backends")}):
    out.append("editable")
print(" ".join(out))
PROBE
)
needs() { [[ " $missing " == *" $1 "* ]]; }

# What is missing is installed in one pip call (each call costs seconds of start-up and
# resolution), without byte-compiling all of torch up front (--no-compile: Python compiles what is
# imported, on first import). torch: the 2.13.0 CPU wheel (found on disk through pip's find-links; a
# bare `pip install torch` would pull several GB of CUDA packages). numpy<2.3: the triton 3.6
# interpreter breaks on range(tl.cdiv(...)) with numpy 2.4.
want=()
needs torch && want+=(torch==2.13.0)
needs triton && want+=(triton==3.6.0)
needs z3 && want+=("z3-solver>=4.12")
{ needs numpy || [ ${#want[@]} -gt 0 ]; } && want+=("numpy<2.3")
[ $want_test = 1 ] && needs tools && want+=(pytest pytest-xdist expecttest hypothesis tqdm)
if [ ${#want[@]} -gt 0 ]; then
  echo "[setup] installing ${want[*]}"
  pip install -q --no-compile "${want[@]}" 2>&1 | quiet
fi
# The examples' extras are optional: a failed install (offline, no wheel) leaves the fallback.
if [ $want_examples = 1 ] && needs extras; then
  echo "[setup] installing tqdm matplotlib (optional extras of the examples)"
  pip install -q --no-compile tqdm matplotlib 2>&1 | quiet \
    || echo "[setup] tqdm/matplotlib unavailable; the examples log progress and the loss summary instead"
fi
# fbgemm is optional for users; the fbgemm spelling tests use it when it imports (--no-deps: it
# would otherwise pull its own torch).
if [ $want_test = 1 ] && needs fbgemm; then
  echo "[setup] installing fbgemm-gpu-cpu==1.8.0"
  pip install -q --no-compile --no-deps fbgemm-gpu-cpu==1.8.0 2>&1 | quiet || echo "[setup] fbgemm unavailable; its tests will skip"
fi
# Editable install registers the torch_dynamo_backends entry points ("hstu", "hstu_eager").
if needs editable; then
  pip install -q --no-deps --no-build-isolation -e . 2>&1 | quiet
fi
echo "[setup] ready: $("$VENV/bin/python" -c 'from importlib.metadata import version as v; print("torch", v("torch"), "triton", v("triton"))')"

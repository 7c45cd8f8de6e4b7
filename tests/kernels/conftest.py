"""Kernel tests run the Triton kernels under the interpreter on machines without CUDA.

``TRITON_INTERPRET`` must be set before any triton-dependent module is imported, hence here.
Markers: ``gpu`` (needs CUDA, skipped otherwise), ``slow`` (skipped unless HSTU_RUN_SLOW=1).
"""
import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: long interpreter cases (run with HSTU_RUN_SLOW=1)")


def pytest_collection_modifyitems(config, items):
    run_slow = os.environ.get("HSTU_RUN_SLOW", "0") == "1"
    for item in items:
        if "gpu" in item.keywords and not _HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow; set HSTU_RUN_SLOW=1"))

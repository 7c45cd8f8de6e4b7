"""Shared pytest set-up for the hstu_inductor tests."""
from __future__ import annotations

import os
import sys

import pytest
import torch

# Make ``import _helpers`` work however pytest was invoked (rootdir, -p, a single file, ...).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _seed_everything():
    """Fixed seeds for every test: fresh random inputs, reproducible failures."""
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests are skipped when CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

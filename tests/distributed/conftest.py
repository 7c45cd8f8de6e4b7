"""Distributed tests: 2 CPU processes over gloo, spawned per test module (see _launch.py)."""
import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch built without gloo (torch.distributed)", allow_module_level=True)

"""benchmarks/stu_layer.py's ``gr_fused`` provider maps our STULayer's parameters onto GR's STU ops.

Checked on CPU in fp32 against GR's PyTorch-kernel ops (``HammerKernel.PYTORCH``, the same
``hstu_preprocess_and_attention`` / ``hstu_compute_output`` entry points the provider calls with
``HammerKernel.TRITON`` on a GPU): output, dx and every parameter gradient, with all parameters
perturbed away from their init, for the default layer, concat_ua, a non-default alpha/eps,
max_attn_len and contextual_seq_len. Skips without GR's code (HSTU_ANCHOR_PATH, default ./.anchor)
or fbgemm_gpu (GR's PyTorch attention pads with its ops).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))


def test_gr_fused_mapping_matches_our_layer_cpu():
    pytest.importorskip("fbgemm_gpu")
    import stu_layer

    try:
        stu_layer.gr_ops()
    except stu_layer.AnchorMissing as e:
        pytest.skip(str(e))
    errs = stu_layer.check_mapping_cpu(verbose=False)
    assert len(errs) == 5 * 10  # 5 layer variants x (out, dx, 8 parameters)
    bad = [(case, what, e) for case, what, e in errs if not e <= 1e-5]
    assert not bad, bad

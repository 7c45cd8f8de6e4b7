"""``fuse_u_silu`` (patterns/blocks.py): the preprocess op's ``act = silu(u)``, used only as the output
op's ``u``, is replaced by the pre-activation view ``uvqk[:, :u_dim]`` with ``silu_u=True``; anything
else is left alone. The graph decisions, then the reference STU layer compiled (training and
inference) against eager, and the AOTAutograd graphs (act dead, no ``d_act`` for the preprocess
backward)."""
from __future__ import annotations

import operator

import pytest
import torch

import hstu_inductor
from hstu_inductor import _compat
from hstu_inductor.patterns import rewrite_dynamo_graph
from hstu_inductor.patterns.blocks import _op_arg, fuse_u_silu
from hstu_inductor.reference import STULayer, hstu_mha
from hstu_inductor.reference import stu as ref_stu
from hstu_inductor.report import RewriteReport
from _helpers import rel_err
from test_blocks_common import check_compiled, jagged_rows, rewritten, small_stu_layer

ops = torch.ops.hstu
E, H, DQ, DV, N = 16, 2, 4, 8, 8
C = H * DV
PRE_OPS = (ops.stu_preprocess.default, ops.stu_preprocess_save.default)
OUT_OPS = (ops.stu_output.default, ops.stu_output_save.default)


def _batch(lengths, seed=0):
    return jagged_rows(lengths, E, seed)


def _layer(cls=STULayer, **kw):
    return small_stu_layer(cls, E, H, DQ, DV, **kw)


def _nodes(gm, targets):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def _fused_output(gm):
    """The one output op of ``gm``, asserting whether it got the pre-activation."""
    (pre,), (out,) = _nodes(gm, PRE_OPS), _nodes(gm, OUT_OPS)
    u = _op_arg(out, "u")
    fused = _op_arg(out, "silu_u")
    acts = [n for n in pre.users if n.args[1] == 0]
    if fused:  # u = uvqk[:, :u_dim] and the act output is gone
        assert u.target is torch.ops.aten.slice.Tensor and list(u.args[1:]) == [1, 0, C], u.args
        assert u.args[0].target is operator.getitem and u.args[0].args == (pre, 1)
        assert acts == []
    else:
        assert u.target is operator.getitem and u.args == (pre, 0)
    return fused


# ---------------------------------------------------------------------------------------------
# the pass on hand-written op graphs: when it applies and when not
# ---------------------------------------------------------------------------------------------
def _op_block(act_use, silu_all=False):
    """preprocess -> output with the ops called directly; ``act_use``: how ``act`` is used besides as u."""
    def fn(x, lw, lb, wp, bp, attn, nw, nb, wo, bo):
        act, uvqk = ops.stu_preprocess(x, lw, lb, 1e-5, wp, bp, C, C, silu_all)
        u = act[:, :C] if silu_all else act
        if act_use == "as_attn":
            return ops.stu_output(act, u, x, nw, nb, 1e-5, 0, wo, bo, False)
        out = ops.stu_output(attn, u, x, nw, nb, 1e-5, 0, wo, bo, False) * uvqk[:, -1:]
        return (out, act * 2) if act_use == "also_elsewhere" else out
    return fn


def _op_inputs():
    g = torch.Generator().manual_seed(3)
    L = 6
    shapes = [(L, E), (E,), (E,), (4 * C, E), (4 * C,), (L, C), (C,), (C,), (E, C), (E,)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


@pytest.mark.parametrize("act_use,silu_all,applies", [("u_only", False, True), ("also_elsewhere", False, False),
                                                      ("as_attn", False, False), ("u_only", True, False)])
def test_pass_applies_only_when_exact(act_use, silu_all, applies):
    fn = _op_block(act_use, silu_all)
    inputs = _op_inputs()
    gm = _compat.trace_aten(fn, inputs)
    before = gm.code
    report = RewriteReport()
    assert fuse_u_silu(gm, report) == int(applies)
    if not applies:
        assert gm.code == before and report.details == []
        return
    gm.graph.lint()
    gm.recompile()
    assert _fused_output(gm) and [k for k, _ in report.details] == ["silu(u)"]
    leaves = [t.requires_grad_() for t in _op_inputs()]
    got, want = gm(*leaves), fn(*leaves)
    assert rel_err(got, want) < 1e-13
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
        assert rel_err(a, b) < 1e-12


# ---------------------------------------------------------------------------------------------
# the reference STU layer through the backend
# ---------------------------------------------------------------------------------------------
class AlsoReturnsU(STULayer):
    """Near miss: the caller gets silu(u) too, so the preprocess must still write it."""

    def forward(self, x, seq_offsets, max_seq_len, num_targets=None):
        p = dict(self.named_parameters(recurse=False))
        u, v, q, k = ref_stu.stu_preprocess(x, p["ln_weight"], p["ln_bias"], p["w_uvqk"], p["b_uvqk"], H, DQ, DV,
                                            self.eps)
        attn = hstu_mha(max_seq_len, self.alpha, q, k, v, seq_offsets, causal=True).reshape(x.shape[0], C)
        out = ref_stu.stu_output(attn, u, x, p["norm_weight"], p["norm_bias"], p["w_o"], p["b_o"], H, self.eps,
                                 self.concat_ua)
        return out, u


def test_stu_layer_graph():
    graphs, report = rewritten(_layer(), *_batch([3, 5]), N)
    assert _fused_output(graphs[0]), report
    assert sum(k == "silu(u)" for k, _ in report.details) == 1, report
    with hstu_inductor.config.patch(fuse_u_silu=False):
        graphs, report = rewritten(_layer(), *_batch([3, 5]), N)
    assert not _fused_output(graphs[0])


def test_stu_layer_inductor_train_and_eval():
    """backend="hstu" (Inductor) with the pass: eager-equal outputs and every gradient, then inference."""
    m = _layer(concat_ua=True)
    counts = {"preprocess": 1, "output": 1}
    report = check_compiled(m, *_batch([3, 5], seed=1), N, train=True, counts=counts, backend="hstu")
    assert ("silu(u)" in [k for k, _ in report.details]), report
    m.eval()
    report = check_compiled(m, *_batch([4, 2], seed=2), N, train=False, counts=counts, backend="hstu")
    assert ("silu(u)" in [k for k, _ in report.details]), report


def test_act_with_another_user_is_left_alone():
    m = _layer(AlsoReturnsU)
    graphs, report = rewritten(m, *_batch([3, 5]), N)
    assert not _fused_output(graphs[0]) and "silu(u)" not in [k for k, _ in report.details], report
    check_compiled(m, *_batch([3, 5], seed=3), N, train=True, counts={"preprocess": 1, "output": 1})


def _aot_graphs(m, x, off):
    """``(forward, backward)`` graphs AOTAutograd makes of the rewritten layer, the hstu ops kept whole."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(rewrite_dynamo_graph(gm), example_inputs)

    torch._dynamo.reset()
    with torch._functorch.config.patch(decompose_custom_triton_ops=False):
        x = x.requires_grad_()
        out = torch.compile(m, backend=backend)(x, off, N)
        torch.autograd.grad(out.sum(), [x, *m.parameters()])
    return graphs


@pytest.mark.skipif(not hasattr(torch._functorch.config, "decompose_custom_triton_ops"),
                    reason="this torch traces into the triton_op bodies")
def test_aot_graphs_have_no_act():
    """The forward never reads the preprocess op's act (Inductor drops what computes it once the op's
    body is inlined); the preprocess backward gets no d_act; the output backward gets silu_u."""
    fwd, bwd = _aot_graphs(_layer(), *_batch([3, 5], seed=4))
    (pre,) = _nodes(fwd, PRE_OPS)
    assert [n.args[1] for n in pre.users] and 0 not in [n.args[1] for n in pre.users]
    (pre_bwd,) = _nodes(bwd, (ops.stu_preprocess_bwd.default,))
    assert _op_arg(pre_bwd, "d_act") is None and _op_arg(pre_bwd, "d_uvqk") is not None
    (out_bwd,) = _nodes(bwd, (ops.stu_output_bwd.default,))
    assert _op_arg(out_bwd, "silu_u") is True

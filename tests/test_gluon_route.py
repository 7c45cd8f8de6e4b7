"""Which forward ``hstu::attention`` and which backward ``hstu::attention_bwd`` pick on CUDA (ops/_gluon.py),
tested on CPU with the device check mocked: the Gluon kernels launched directly in plain eager, through the opaque
``hstu::_gluon_fwd`` / ``hstu::_gluon_bwd`` while traced, never under torch.export / AOTInductor / Inductor's C++
wrapper, never outside their scope, never with config.gluon="off". The op-level tests replace the kernel modules
by the eager reference, so the wiring of the ops' bodies is checked without a GPU.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import hstu_inductor  # noqa: F401  (registers torch.ops.hstu.*)
from hstu_inductor import config
from hstu_inductor.ops import _gluon
from hstu_inductor.spec import AttentionSpec


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(_gluon, "_device_ok", lambda device: True)
    monkeypatch.setattr(_gluon, "_module", lambda: object())
    monkeypatch.setattr(_gluon, "_bwd_module", lambda: object())


def _qkv(L=10, H=2, D=128, dtype=torch.bfloat16, fused=True):
    if fused:  # views of one projection, like the STU layer's uvqk split
        x = torch.randn(L, 4 * H * D).to(dtype)
        return x[:, H * D:2 * H * D].view(L, H, D), x[:, 2 * H * D:3 * H * D].view(L, H, D), \
            x[:, 3 * H * D:].view(L, H, D)
    return tuple(torch.randn(L, H, D).to(dtype) for _ in range(3))


def _route(q, k, v, nt=None, scale=None, w=0, c=0, f=0, causal=True, bias=False):
    return _gluon.route(q, k, v, nt, scale, AttentionSpec(causal, w, c, f), bias)


def test_eager_direct(sm90):
    q, k, v = _qkv()
    assert _route(q, k, v) == "direct"
    assert _route(q, k, v, nt=torch.tensor([1])) == "direct"
    assert _route(*_qkv(fused=False, dtype=torch.float16)) == "direct"


def test_out_of_scope(sm90):
    q, k, v = _qkv()
    assert _route(q, k, v, scale=torch.tensor(0.5)) is None
    assert _route(q, k, v, w=4) is None
    assert _route(q, k, v, c=2) is None
    assert _route(q, k, v, f=3) is None
    assert _route(q, k, v, causal=False) is None
    assert _route(q, k, v, bias=True) is None
    assert _route(*_qkv(D=64)) is None
    assert _route(*_qkv(dtype=torch.float32)) is None
    x = torch.randn(10, 2, 256).to(torch.bfloat16)[:, :, :128]  # stride(1) != 128: heads not adjacent
    assert _route(x, x, x) is None
    y = torch.randn(10 * 2 * 128 + 4).to(torch.bfloat16)[4:].view(10, 2, 128)  # base 8 B off 16-byte alignment
    assert _route(y, y, y) is None


def test_config_off(sm90):
    q, k, v = _qkv()
    with config.patch(gluon="off"):
        assert _route(q, k, v) is None


def test_no_device_or_module(monkeypatch):
    q, k, v = _qkv()
    assert _route(q, k, v) is None  # CPU tensors: not an sm90 device
    monkeypatch.setattr(_gluon, "_device_ok", lambda device: True)
    monkeypatch.setattr(_gluon, "_module", lambda: None)
    assert _route(q, k, v) is None


def _route_bwd(g, q, k, v, nt=None, scale=None, w=0, c=0, f=0, causal=True, bias=False, scale_grad=False):
    return _gluon.route_bwd(g, q, k, v, nt, scale, AttentionSpec(causal, w, c, f), bias, scale_grad)


def _traced_route(q, k, v, bwd=False):
    got = []

    def f(q, k, v):
        got.append(_route_bwd(torch.ones_like(q), q, k, v) if bwd else _route(q, k, v))
        return q + 1

    make_fx(f, tracing_mode="fake")(q, k, v)
    return got[0]


@pytest.mark.parametrize("bwd", [False, True], ids=["fwd", "bwd"])
def test_traced_uses_the_opaque_op(sm90, bwd):
    q, k, v = _qkv(fused=False)
    assert _traced_route(q, k, v, bwd) == "op"


@pytest.mark.parametrize("bwd", [False, True], ids=["fwd", "bwd"])
def test_aot_and_export_keep_triton(sm90, monkeypatch, bwd):
    q, k, v = _qkv(fused=False)
    from torch._inductor import config as inductor_config

    with inductor_config.patch(cpp_wrapper=True):
        assert _traced_route(q, k, v, bwd) is None
    from torch._inductor.virtualized import V

    with V.set_aot_compilation(True):
        assert _traced_route(q, k, v, bwd) is None
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    assert _traced_route(q, k, v, bwd) is None


def test_bwd_eager_direct(sm90):
    q, k, v = _qkv()
    g = torch.ones_like(q)
    assert _route_bwd(g, q, k, v) == "direct"
    assert _route_bwd(g, q, k, v, nt=torch.tensor([1])) == "direct"
    assert _route_bwd(g.float(), q, k, v) == "direct"  # gluon_backward casts dO to q's dtype
    assert _route_bwd(g.transpose(0, 1).contiguous().transpose(0, 1), q, k, v) == "direct"  # and copies it
    with config.patch(deterministic=True):  # the Gluon backward has no atomics: it serves both
        assert _route_bwd(g, q, k, v) == "direct"


def test_bwd_out_of_scope(sm90, monkeypatch):
    q, k, v = _qkv()
    g = torch.ones_like(q)
    assert _route_bwd(g, q, k, v, scale=torch.tensor(0.5), scale_grad=True) is None
    assert _route_bwd(g, q, k, v, scale=torch.tensor(0.5)) is None
    assert _route_bwd(g, q, k, v, w=4) is None
    assert _route_bwd(g, q, k, v, causal=False) is None
    assert _route_bwd(g, q, k, v, bias=True) is None
    assert _route_bwd(g[:5], q, k, v) is None  # dO of another shape
    assert _route_bwd(g[0], q, k, v) is None
    for q2, k2, v2 in (_qkv(D=64), _qkv(dtype=torch.float32)):
        assert _route_bwd(torch.ones_like(q2), q2, k2, v2) is None
    x = torch.randn(10, 2, 256).to(torch.bfloat16)[:, :, :128]  # heads not adjacent
    assert _route_bwd(g, x, x, x) is None
    with config.patch(gluon="off"):
        assert _route_bwd(g, q, k, v) is None
    monkeypatch.setattr(_gluon, "_bwd_module", lambda: None)  # a Triton with the forward kernel only
    assert _route_bwd(g, q, k, v) is None
    assert _route(q, k, v) == "direct"


def test_fake_impl():
    with FakeTensorMode():
        q = torch.empty(7, 3, 128, dtype=torch.bfloat16)
        off = torch.zeros(3, dtype=torch.int64)
        out = torch.ops.hstu._gluon_fwd(q, q, q, off, 64, 0.1, None)
        assert out.shape == (7, 3, 128) and out.dtype == torch.bfloat16 and out.is_contiguous()
        grads = torch.ops.hstu._gluon_bwd(q, q, q, q, off, 64, 0.1, None)
        assert len(grads) == 3
        for g in grads:
            assert g.shape == (7, 3, 128) and g.dtype == torch.bfloat16 and g.is_contiguous()


# --- the ops' bodies: Gluon and Triton kernel modules replaced by the eager reference, recording their calls ---


@pytest.fixture
def stand_ins(monkeypatch):
    """CPU tensors take the CUDA branch of the ops; each kernel entry point appends its name to the list."""
    import importlib
    from types import SimpleNamespace

    from hstu_inductor.reference import hstu_mha, hstu_mha_backward

    calls = []

    def fwd(name):
        def run(q, k, v, off, N, alpha, nt=None, scale=None, w=0, c=0, f=0, causal=True, **kw):
            calls.append(name)
            return hstu_mha(N, alpha, q, k, v, off, causal=causal, training=False, num_targets=nt, attn_scale=scale,
                            max_attn_len=w, contextual_seq_len=c, min_full_attn_seq_len=f).contiguous()
        return run

    def bwd(name):
        def run(g, q, k, v, off, N, alpha, nt=None, scale=None, w=0, c=0, f=0, causal=True, **kw):
            calls.append(name)
            got = hstu_mha_backward(g, N, alpha, q, k, v, off, causal, nt, scale, w, c, f)
            return tuple(t.contiguous() for t in got[:3])
        return run

    triton = SimpleNamespace(hstu_attention_fwd=fwd("triton_fwd"), hstu_attention_bwd=bwd("triton_bwd"),
                             uses_tma=lambda *a: False)
    monkeypatch.setattr(importlib.import_module("hstu_inductor.ops._kernels"), "kernels_for", lambda t: triton)
    monkeypatch.setattr(_gluon, "_device_ok", lambda device: True)
    monkeypatch.setattr(_gluon, "_module", lambda: SimpleNamespace(gluon_forward=fwd("gluon_fwd")))
    monkeypatch.setattr(_gluon, "_bwd_module", lambda: SimpleNamespace(gluon_backward=bwd("gluon_bwd")))
    return calls


def _step(fn, w=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    off = torch.tensor([0, 5, 5, 9])
    q, k, v = (torch.randn(9, 2, 128, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))
    nt = torch.tensor([1, 0, 2])
    out = fn(q, k, v, off, nt, w)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def _op(q, k, v, off, nt, w):
    return torch.ops.hstu.attention(q, k, v, off, 5, 0.1, nt, None, w, 0, 0, True)


def test_op_eager_step_uses_gluon(stand_ins):
    got = _step(_op)
    assert stand_ins == ["gluon_fwd", "gluon_bwd"]
    stand_ins.clear()
    with config.patch(gluon="off"):
        ref = _step(_op)
    assert stand_ins == ["triton_fwd", "triton_bwd"]
    for a, b in zip(got, ref):  # the Gluon results land in the ops' outputs unchanged
        assert torch.equal(a, b)


def test_op_eager_out_of_scope_keeps_triton(stand_ins):
    _step(_op, w=3)  # a window
    assert stand_ins == ["triton_fwd", "triton_bwd"]


def test_op_compiled_step_uses_the_opaque_ops(stand_ins):
    torch._dynamo.reset()
    fn = torch.compile(_op, backend="aot_eager", fullgraph=True)
    _step(fn)
    stand_ins.clear()
    got = _step(fn)  # compiled already: what runs now is the graphs' calls of hstu::_gluon_fwd / _gluon_bwd
    assert stand_ins == ["gluon_fwd", "gluon_bwd"]
    stand_ins.clear()
    for a, b in zip(got, _step(_op)):
        assert torch.equal(a, b)
    torch._dynamo.reset()

"""Which forward ``hstu::attention`` picks on CUDA (ops/_gluon.py), tested on CPU with the device check mocked:
the Gluon kernel launched directly in plain eager, through the opaque ``hstu::_gluon_fwd`` while traced, never
under torch.export / AOTInductor / Inductor's C++ wrapper, never outside its scope, never with config.gluon="off".
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import hstu_inductor  # noqa: F401  (registers torch.ops.hstu.*)
from hstu_inductor import config
from hstu_inductor.ops import _gluon


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(_gluon, "_device_ok", lambda device: True)
    monkeypatch.setattr(_gluon, "_module", lambda: object())


def _qkv(L=10, H=2, D=128, dtype=torch.bfloat16, fused=True):
    if fused:  # views of one projection, like the STU layer's uvqk split
        x = torch.randn(L, 4 * H * D).to(dtype)
        return x[:, H * D:2 * H * D].view(L, H, D), x[:, 2 * H * D:3 * H * D].view(L, H, D), \
            x[:, 3 * H * D:].view(L, H, D)
    return tuple(torch.randn(L, H, D).to(dtype) for _ in range(3))


def _route(q, k, v, nt=None, scale=None, w=0, c=0, f=0, causal=True, bias=False):
    return _gluon.route(q, k, v, nt, scale, w, c, f, causal, bias)


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


def _traced_route(q, k, v):
    got = []

    def f(q, k, v):
        got.append(_route(q, k, v))
        return q + 1

    make_fx(f, tracing_mode="fake")(q, k, v)
    return got[0]


def test_traced_uses_the_opaque_op(sm90):
    q, k, v = _qkv(fused=False)
    assert _traced_route(q, k, v) == "op"


def test_aot_and_export_keep_triton(sm90, monkeypatch):
    q, k, v = _qkv(fused=False)
    from torch._inductor import config as inductor_config

    with inductor_config.patch(cpp_wrapper=True):
        assert _traced_route(q, k, v) is None
    from torch._inductor.virtualized import V

    with V.set_aot_compilation(True):
        assert _traced_route(q, k, v) is None
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    assert _traced_route(q, k, v) is None


def test_fake_impl():
    with FakeTensorMode():
        q = torch.empty(7, 3, 128, dtype=torch.bfloat16)
        off = torch.zeros(3, dtype=torch.int64)
        out = torch.ops.hstu._gluon_fwd(q, q, q, off, 64, 0.1, None)
        assert out.shape == (7, 3, 128) and out.dtype == torch.bfloat16 and out.is_contiguous()

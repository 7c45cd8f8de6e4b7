"""With every pattern off, ``backend="hstu"`` must be stock Inductor: same outputs, same gradients."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hstu_inductor
from _helpers import SMALL_LENGTHS, SMALL_NUM_ITEMS, rel_err, small_hstu_batch, small_hstu_model

ALL_OFF = {"attention": False, "preprocess": False, "output": False}


def _run(model, backend, batch):
    """Compiled forward + backward; returns (logits, {param name: grad})."""
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    ids, off, nt, labels = batch
    compiled = torch.compile(model, backend=backend)
    logits = compiled(ids, off, nt)
    F.cross_entropy(logits, labels).backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# with every pattern off the model's variant changes nothing of ours: the variants run under -m slow
@pytest.mark.parametrize("kw", [dict(), pytest.param(dict(concat_ua=True, group_norm=True, max_attn_len=2),
                                                     marks=pytest.mark.slow)], ids=["default", "variants"])
def test_hstu_equals_inductor_with_patterns_off(kw):
    base = small_hstu_model(**kw)
    batch = small_hstu_batch()
    with hstu_inductor.config.patch(patterns=ALL_OFF):
        out_h, grads_h = _run(copy.deepcopy(base), "hstu", batch)
    out_i, grads_i = _run(copy.deepcopy(base), "inductor", batch)
    assert out_h.shape == (sum(SMALL_LENGTHS), SMALL_NUM_ITEMS)
    assert rel_err(out_h, out_i) < 1e-6
    assert grads_h.keys() == grads_i.keys()
    for name in grads_i:
        assert rel_err(grads_h[name], grads_i[name]) < 1e-6, name

    # ... and both agree with eager.
    eager = copy.deepcopy(base)
    ids, off, nt, labels = batch
    logits = eager(ids, off, nt)
    F.cross_entropy(logits, labels).backward()
    assert rel_err(out_h, logits) < 1e-4
    for name, p in eager.named_parameters():
        assert rel_err(grads_h[name], p.grad) < 1e-3, name


def test_hstu_backend_on_plain_function_matches_inductor():
    def fn(x, w):
        return F.layer_norm(x @ w, (w.shape[1],)).relu() * x.sum(-1, keepdim=True)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(8, 4, generator=g, requires_grad=True)
    with hstu_inductor.config.patch(patterns=ALL_OFF):
        a = torch.compile(fn, backend="hstu")(x, w)
    (ga,) = torch.autograd.grad(a.square().sum(), w)
    torch._dynamo.reset()
    b = torch.compile(fn, backend="inductor")(x, w)
    (gb,) = torch.autograd.grad(b.square().sum(), w)
    assert rel_err(a, b) < 1e-6 and rel_err(ga, gb) < 1e-6

"""End-to-end checks on a CUDA GPU: ops -> Triton kernels, backend="hstu" puts our kernels into
Inductor's generated code, and the AOTInductor package carries them. Skipped without CUDA."""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
import torch
from torch.export import Dim

import hstu_inductor
import hstu_inductor.export as hx
import hstu_inductor.report
from hstu_inductor.reference import HSTUModel, hstu_mha

from _helpers import rel_err

pytestmark = pytest.mark.gpu

BF16_TOL, FP32_TOL = 2e-2, 2e-3  # relative-norm bounds vs an fp64 reference (tf32/bf16 matmuls)


def _jagged(lengths, H, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    L = int(off[-1])
    uvqk = torch.randn(L, 4 * H * D, device="cuda", generator=g, dtype=dtype)
    # strided views of one projection, as in real models
    q, k, v = (uvqk[:, i * H * D:(i + 1) * H * D].view(L, H, D) for i in (1, 2, 3))
    return q, k, v, off


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_op_fwd_bwd_cuda(dtype):
    N, H, D = 256, 2, 64
    q, k, v, off = _jagged([256, 1, 0, 200, 77], H, D, dtype, seed=1)
    nt = torch.tensor([3, 0, 0, 20, 1], device="cuda")
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.ops.hstu.attention(qq, kk, vv, off, N, 1.0 / D, nt, None, 0, 0, 0, True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qq, kk, vv), dout)
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = hstu_mha(N, 1.0 / D, *r, off, num_targets=nt)
    ref_grads = torch.autograd.grad(ref, r, dout.double())
    tol = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
    assert rel_err(out.double(), ref) < tol
    for g, rg in zip(grads, ref_grads):
        assert rel_err(g.double(), rg) < tol


@pytest.mark.parametrize("backend", ["hstu", "hstu_eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backend_attention_matches_reference(dtype, backend):
    """backend="hstu" on the plain reference at a real shape, every dtype, fwd and grads vs fp64.

    Guards the Inductor path itself: it launches the kernels with its own argument handling (for
    example Python floats become fp64 kernel arguments), which a direct-launch test never sees.
    "hstu_eager" runs the same rewritten graph through AOTAutograd eagerly (the kernels launched
    by the ops' own bodies)."""
    N, H, D = 1024, 2, 128
    g = torch.Generator().manual_seed(5)
    lengths = [N, 1, 0, *torch.randint(N // 2, N, (5,), generator=g).tolist()]
    q, k, v, off = _jagged(lengths, H, D, dtype, seed=3)
    nt = torch.randint(1, 20, (len(lengths),), generator=g).clamp(max=torch.tensor(lengths)).cuda()

    def attn(q, k, v, off, nt):
        return hstu_mha(N, 1.0 / D, q, k, v, off, causal=True, num_targets=nt)

    torch._dynamo.reset()
    compiled = torch.compile(attn, backend=backend)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    with hstu_inductor.report.collecting() as report:
        out = compiled(qq, kk, vv, off, nt)
    assert report.counts["attention"] == 1, str(report)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qq, kk, vv), dout)
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attn(*r, off, nt)
    ref_grads = torch.autograd.grad(ref, r, dout.double())
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert rel_err(out.double(), ref) < tol
    for name, g_, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g_.double(), rg) < tol, f"d{name}"
    with torch.no_grad():  # the inference graph is compiled separately
        assert rel_err(compiled(q, k, v, off, nt).double(), ref) < tol


def test_backend_symbolic_max_len():
    """A max length passed as a changing Python int becomes a SymInt after Dynamo's automatic-dynamic
    recompile; the dynamic graph must still use our kernels, with the runtime N (mask and 1/N)."""
    H, D = 2, 64
    g = torch.Generator().manual_seed(8)

    def attn(q, k, v, off, N):
        return hstu_mha(N, 1.0 / D, q, k, v, off, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(attn, backend="hstu")
    graphs = 0
    for N in (256, 320, 384):
        lengths = [N, 1, 0, *torch.randint(N // 2, N, (3,), generator=g).tolist()]
        q, k, v, off = _jagged(lengths, H, D, torch.bfloat16, seed=N)
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        with hstu_inductor.report.collecting() as report:
            out = compiled(qq, kk, vv, off, N)
        graphs += report.graphs
        if N == 320:  # the automatic-dynamic recompile (symbolic N) must be rewritten too
            assert report.graphs == 1 and report.counts["attention"] == 1, str(report)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (qq, kk, vv), dout)
        r = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attn(*r, off, N)
        ref_grads = torch.autograd.grad(ref, r, dout.double())
        assert rel_err(out.double(), ref) < BF16_TOL, N
        for name, g_, rg in zip("qkv", grads, ref_grads):
            assert rel_err(g_.double(), rg) < BF16_TOL, f"d{name} N={N}"
    assert graphs == 2, "expected one static graph and one dynamic recompile"


def test_backend_puts_kernels_into_generated_code():
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = HSTUModel(100, 64, embedding_dim=64, num_layers=2, num_heads=2, attn_dim=32, hidden_dim=32).cuda()
    g = torch.Generator().manual_seed(2)
    lengths = [64, 30, 5, 50]
    off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]).cuda()
    ids = torch.randint(0, 100, (int(off[-1]),), generator=g).cuda()
    report = hstu_inductor.explain(model, ids, off)
    assert report.counts == {"attention": 2, "preprocess": 2, "output": 2}, str(report)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="hstu")

    def step():
        out = compiled(ids, off)
        out.square().mean().backward()
        return out

    out, codes = run_and_get_code(step)
    code = "\n".join(codes)
    assert "_hstu_fwd_kernel" in code and "_hstu_bwd_dkdv_kernel" in code, "our kernels are not in Inductor's code"
    assert "torch.ops.hstu" not in code, "an hstu op stayed an opaque call"
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(ids, off)
    ref.square().mean().backward()
    assert rel_err(out, ref) < FP32_TOL
    for gc, p in zip(grads, model.parameters()):
        if p.grad is not None and p.grad.norm() > 0:
            assert rel_err(gc, p.grad) < 10 * FP32_TOL


def test_cuda_package_contains_kernels(tmp_path):
    torch.manual_seed(0)
    model = HSTUModel(100, 64, embedding_dim=64, num_layers=1, num_heads=2, attn_dim=32, hidden_dim=32).cuda().eval()
    off = torch.tensor([0, 64, 90, 140], device="cuda")
    ids = torch.randint(0, 100, (140,), device="cuda")
    path = str(tmp_path / "m.pt2")
    result = hx.export_and_package(model, (ids, off), dynamic_shapes=({0: Dim.AUTO}, {0: Dim.AUTO}),
                                   package_path=path)
    assert result.report.counts["attention"] == 1
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        blobs = b"".join(z.read(n) for n in names)
    assert any(n.endswith((".cubin", ".hsaco", ".fatbin")) for n in names), names
    assert b"_hstu_fwd_kernel" in blobs and b"hstu::" not in blobs
    # Loading runs in a subprocess only: on the device machines any CUDA .pt2 segfaults on load.
    with torch.no_grad():
        expected = model(ids, off).cpu()
    torch.save({"ids": ids.cpu(), "off": off.cpu(), "expected": expected}, tmp_path / "io.pt")
    script = f"""
import sys, torch
d = torch.load({str(tmp_path / 'io.pt')!r})
out = torch._inductor.aoti_load_package({path!r})(d["ids"].cuda(), d["off"].cuda()).cpu()
assert "hstu_inductor" not in sys.modules
err = ((out - d["expected"]).norm() / d["expected"].norm()).item()
assert err < {FP32_TOL}, err
print("fresh-process ok", err)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    if proc.returncode == -11:
        pytest.xfail("known: any CUDA .pt2 segfaults on load in a fresh process on the device machines")
    assert proc.returncode == 0 and "fresh-process ok" in proc.stdout, proc.stderr[-3000:]

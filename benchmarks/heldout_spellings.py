"""Plain-PyTorch STU layers in spellings neither the grammar nor the metamorphic transformations write,
each trained under stock Inductor and under ``backend="hstu"`` side by side.

    python benchmarks/heldout_spellings.py --device cuda --out OUTDIR      # B=32, N=1024, E=512, H=4, D=128, bf16
    python benchmarks/heldout_spellings.py --fake                          # B=128, N=4096 under FakeTensorMode (CPU)
    python benchmarks/heldout_spellings.py --check                         # small, CPU: rewritten and equal to eager

Spellings (``--spelling``), one model each:
- ``setitem_pad``: q, k, v written into a zero ``[B, N, H, D]`` buffer by ``z[seg, pos] = t``; the mask a
  float ``tril`` multiplied in; unpadded by reading ``dense[seg, pos]``.
- ``index_add_pad``: ``zeros(B*N, F).index_add_(0, seg * N + pos, t)``; ``where`` on an arange mask.
- ``unbind4``: the projection cut by ``view(L, 4, H, D).unbind(1)``; 2-D ``index_put`` pads.
- ``head_loop``: a Python loop over heads on slices of one padded tensor, ``silu_`` and ``masked_fill_``
  in place, heads concatenated before the unpad.
- ``buffer_mask``: the original HSTU's mask: a registered ``triu(ones(N, N), 1)`` buffer, ``1 - mask``
  multiplied in after the silu.
- ``lengths_window``: per-sequence lengths and num_targets as inputs, offsets ``F.pad(cumsum)``, a pad
  by ``gather`` times the validity mask, and a window of ``N // 4`` on target-clamped ids written with
  ``where`` / ``logical_and`` / ``~(d > w)``.

``--device cuda``: every model's first (static) compile in a fresh Dynamo cache, as a user's first run;
the report of ``explain`` (what was rewritten), the relative error of the output and of dx against eager,
and one training step (forward and backward, ``do_bench`` median) for stock Inductor and for
``backend="hstu"``, in the same process. Writes ``heldout_spellings.csv``. ``--host``: also each step's host
time with the GPU stalled and its kernel time (the profiler's sum; a step whose host time exceeds its kernel
time is bound by the host); ``--cprofile``: with it,
a cProfile of eight steps per model and backend (``heldout_cprofile_*.txt``).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

log = logging.getLogger("heldout_spellings")


class _Layer(torch.nn.Module):
    """Norm, projection, attention (``attend``, per spelling), output block."""

    inputs = ("x", "offsets")

    def __init__(self, E, H, D, N):
        super().__init__()
        self.H, self.D, self.N = H, D, N
        self.ln = torch.nn.LayerNorm(E)
        self.proj = torch.nn.Linear(E, 4 * H * D)
        self.ln_out = torch.nn.LayerNorm(H * D)
        self.out = torch.nn.Linear(H * D, E)

    def rows(self, offsets, L):
        seg = torch.searchsorted(offsets, torch.arange(L, device=offsets.device), right=True) - 1
        return seg, torch.arange(L, device=offsets.device) - offsets[seg]

    def forward(self, x, offsets, *extra):
        u, v, q, k = self.proj(self.ln(x)).split(self.H * self.D, dim=-1)
        a = self.attend(q, k, v, offsets, *extra)
        return x + self.out(F.silu(u) * self.ln_out(a))


class SetItemPad(_Layer):
    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        seg, pos = self.rows(offsets, L)

        def pad(t):
            z = t.new_zeros(B, N, H, D)
            z[seg, pos] = t.view(L, H, D)
            return z
        qp, kp, vp = pad(q), pad(k), pad(v)
        s = torch.einsum("bihd,bjhd->bhij", qp, kp)
        p = F.silu(s * D ** -0.5) * torch.ones(N, N, device=q.device, dtype=q.dtype).tril() / N
        return torch.einsum("bhij,bjhd->bihd", p, vp)[seg, pos].reshape(L, H * D)


class IndexAddPad(_Layer):
    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        seg, pos = self.rows(offsets, L)
        dst = seg * N + pos

        def pad(t):
            return torch.zeros(B * N, H * D, dtype=t.dtype, device=t.device).index_add_(0, dst, t).view(B, N, H, D)
        qp, kp, vp = pad(q), pad(k), pad(v)
        s = torch.einsum("bihd,bjhd->bhij", qp, kp)
        i = torch.arange(N, device=q.device)
        p = torch.where(i[:, None] >= i[None, :], F.silu(s / D ** 0.5), 0) / N
        return torch.einsum("bhij,bjhd->bihd", p, vp).reshape(B * N, H * D)[dst]


class Unbind4(_Layer):
    def forward(self, x, offsets):
        L, H, D = x.shape[0], self.H, self.D
        u, v, q, k = self.proj(self.ln(x)).view(L, 4, H, D).unbind(1)
        a = self.attend(q, k, v, offsets)
        return x + self.out(F.silu(u.reshape(L, H * D)) * self.ln_out(a))

    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        seg, pos = self.rows(offsets, L)

        def pad(t):
            return torch.zeros(B, N, H, D, dtype=t.dtype, device=t.device).index_put((seg, pos), t)
        qp, kp, vp = pad(q), pad(k), pad(v)
        s = torch.einsum("bihd,bjhd->bhij", qp, kp)
        i = torch.arange(N, device=q.device)
        p = torch.where(i[:, None] >= i[None, :], F.silu(s / D ** 0.5), 0) / N
        return torch.einsum("bhij,bjhd->bihd", p, vp)[seg, pos].reshape(L, H * D)


class HeadLoop(_Layer):
    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        seg, pos = self.rows(offsets, L)

        def pad(t):
            return torch.zeros(B, N, H * D, dtype=t.dtype, device=t.device).index_put((seg, pos), t)
        qp, kp, vp = pad(q), pad(k), pad(v)
        causal = torch.tril(torch.ones(N, N, dtype=torch.bool, device=q.device))
        heads = []
        for h in range(H):
            cols = slice(h * D, (h + 1) * D)
            s = torch.bmm(qp[:, :, cols], kp[:, :, cols].transpose(1, 2)) / D ** 0.5
            s = F.silu(s, inplace=True)
            s.masked_fill_(~causal, 0.0)
            heads.append(torch.bmm(s, vp[:, :, cols]) / N)
        return torch.cat(heads, -1)[seg, pos]


class BufferMask(_Layer):
    def __init__(self, E, H, D, N):
        super().__init__(E, H, D, N)
        self.register_buffer("attn_mask", torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=1))

    def attend(self, q, k, v, offsets):
        L, B, H, D, N = q.shape[0], offsets.numel() - 1, self.H, self.D, self.N
        seg, pos = self.rows(offsets, L)

        def pad(t):
            return torch.zeros(B, N, H * D, dtype=t.dtype, device=t.device).index_put((seg, pos), t).view(B, N, H, D)
        qp, kp, vp = pad(q), pad(k), pad(v)
        keep = 1.0 - self.attn_mask.to(q.dtype)
        p = F.silu(torch.einsum("bnhd,bmhd->bhnm", qp, kp) / D ** 0.5) / N * keep[None, None]
        return torch.einsum("bhnm,bmhd->bnhd", p, vp)[seg, pos].reshape(L, H * D)


class LengthsWindow(_Layer):
    inputs = ("x", "lengths", "num_targets")

    def forward(self, x, lengths, num_targets):
        offsets = F.pad(lengths.cumsum(0), (1, 0))
        return super().forward(x, offsets, lengths, num_targets)

    def attend(self, q, k, v, offsets, lengths, num_targets):
        L, B, H, D, N = q.shape[0], lengths.numel(), self.H, self.D, self.N
        col = torch.arange(N, device=q.device)
        valid = col[None] < lengths[:, None]
        idx = (offsets[:-1, None] + col[None]).clamp(max=L - 1)

        def pad(t):
            g = torch.gather(t, 0, idx.reshape(-1, 1).expand(-1, H * D)).view(B, N, H, D)
            return g * valid[:, :, None, None].to(t.dtype)
        qp, kp, vp = pad(q), pad(k), pad(v)
        ids = torch.minimum(col[None], (lengths - num_targets)[:, None])
        d = ids[:, :, None] - ids[:, None, :]
        w = N // 4
        same = col[:, None] == col[None, :]
        m = torch.logical_and(torch.where(same[None], True, d > 0), ~(d > w))
        s = F.silu(torch.einsum("bnhd,bmhd->bhnm", qp, kp) * D ** -0.5)
        o = torch.einsum("bhnm,bmhd->bnhd", s.masked_fill(~m[:, None], 0.0) / N, vp)
        seg, pos = self.rows(offsets, L)
        return o[seg, pos].reshape(L, H * D)


SPELLINGS = {"setitem_pad": SetItemPad, "index_add_pad": IndexAddPad, "unbind4": Unbind4, "head_loop": HeadLoop,
             "buffer_mask": BufferMask, "lengths_window": LengthsWindow}


def make_inputs(model, B, N, E, device="cpu", dtype=torch.float32, seed=0, fake=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.9 * N), N + 1, (B,), generator=g)
    lengths[0] = N
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    L = int(offsets[-1])
    nt = torch.randint(0, 8, (B,), generator=g).clamp(max=lengths)
    x = torch.empty(L, E, device="meta", dtype=dtype) if fake else torch.randn(L, E, generator=g).to(device, dtype)
    named = {"x": x, "offsets": offsets.to(device), "lengths": lengths.to(device),
             "num_targets": nt.to(device)}
    return tuple(named[n] for n in model.inputs)


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def check(names, dynamic_modes=(False, True)):
    """Small, CPU: every spelling rewritten in full (attention, preprocess, output) and equal to eager."""
    import hstu_inductor

    ok = True
    for name in names:
        for dynamic in dynamic_modes:
            torch.manual_seed(0)
            model = SPELLINGS[name](16, 2, 8, 16)
            args = make_inputs(model, 4, 16, 16)
            rep = hstu_inductor.explain(model, *args, dynamic=dynamic, backend="hstu_eager")
            err = rel(rep.output, model(*args))
            heads = 2 if name == "head_loop" else 1
            full = rep.counts == {"attention": heads, "preprocess": 1, "output": 1}
            ok = ok and full and err < 1e-5
            print(f"{name:15s} dynamic={dynamic!s:5s} {rep.counts} rel err {err:.1e} {rep.near_misses or ''}")
    return ok


def fake(names, B=128, N=4096, E=512, H=4, D=128):
    """B=128, N=4096 static under FakeTensorMode (nothing allocated): what is rewritten, and the time."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hstu_inductor.report import collecting

    for name in names:
        torch._dynamo.reset()
        real = make_inputs(SPELLINGS[name], B, N, E, fake=True)
        with FakeTensorMode() as mode:
            model = SPELLINGS[name](E, H, D, N)
            args = tuple(torch.empty(t.shape, dtype=t.dtype) if t.device.type == "meta" else mode.from_tensor(t)
                         for t in real)
        start = time.perf_counter()
        with collecting() as rep, mode, torch.no_grad():
            try:
                torch.compile(model, backend="hstu_eager", dynamic=False)(*args)
            except Exception as e:  # running the graph on fake inputs of a mode without a shape env
                log.debug("%s: %s", name, e)
        proofs = ", ".join(f"{s:.2f}" for _, _, s in rep.proofs)
        print(f"{name:15s} B={B} N={N}: {rep.counts} in {time.perf_counter() - start:.1f} s "
              f"(proofs {proofs} s) {rep.near_misses or ''}")


def _cprofile(step, stall, path, steps=8):
    """cProfile of ``steps`` steps issued while the GPU is stalled (the host never waits), to ``path``: where a
    step's host time goes, by function, in microseconds per step. cProfile's own cost inflates every figure
    (most for Python functions called often); read the proportions."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    torch.cuda._sleep(stall)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    rows = [(f"{os.path.basename(fn)}:{line}({name})", nc / steps, tt / steps * 1e6, ct / steps * 1e6)
            for (fn, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
    lines = [f"{steps} steps; per step: calls, own us, cumulative us"]
    for title, col in (("by own time", 2), ("by cumulative time", 3)):
        lines.append(f"--- {title}")
        lines += [f"{c:7.1f} {t:9.1f} {cum:9.1f}  {name}" for name, c, t, cum in
                  sorted(rows, key=lambda r: -r[col])[:50]]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    log.warning("wrote %s", path)


def bench(names, args):
    from triton.testing import do_bench

    from _common import compiled_with_counts, host_us, kernel_ms, sleep_cycles_per_ms, write_csv

    device, dtype = "cuda", getattr(torch, args.dtype)
    stall = int(100 * sleep_cycles_per_ms()) if args.host else 0  # 100 ms: longer than 4 steps' host time
    rows = []
    for name in names:
        torch.manual_seed(0)
        model = SPELLINGS[name](args.embedding, args.heads, args.dim, args.n).to(device=device, dtype=dtype)
        inputs = make_inputs(model, args.batch, args.n, args.embedding, device, dtype)
        x = inputs[0].requires_grad_(True)
        ref = model(*inputs)
        gy = torch.randn_like(ref)
        (dx_ref,) = torch.autograd.grad(ref, x, gy)
        times = {}
        for backend in ("inductor", "hstu"):
            compiled, counts = compiled_with_counts(model, inputs, backend)

            def step():
                y = compiled(*inputs)
                return torch.autograd.grad(y, x, gy)[0], y

            dx, y = step()
            err, derr = rel(y, ref), rel(dx, dx_ref)
            ms = do_bench(step, rep=args.rep)
            times[backend] = ms
            host = ""
            if args.host:  # host time per step with the GPU stalled, against its kernel time: bound by which?
                med, best, covered = host_us(step, 4, 10, stall)
                host = f"{med:.0f} us (min {best:.0f}, stall covered {covered:.0%}), kernels {kernel_ms(step):.3f} ms"
                if args.cprofile:
                    _cprofile(step, stall, os.path.join(args.out, f"heldout_cprofile_{name}_{backend}.txt"))
            rows.append(dict(spelling=name, backend=backend, rewritten=counts, ms=round(ms, 3),
                             rel_err_out=f"{err:.2e}", rel_err_dx=f"{derr:.2e}", host_per_step=host))
            print(f"{name:15s} {backend:8s} rewritten {counts or '-':7s} {ms:8.3f} ms  err out {err:.2e} dx {derr:.2e}"
                  f"{'  host ' + host if host else ''}", flush=True)
        print(f"{name:15s} speed-up of hstu over stock Inductor: {times['inductor'] / times['hstu']:.2f}x", flush=True)
    write_csv(rows, args.out, "heldout_spellings.csv")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spelling", nargs="+", default=list(SPELLINGS), choices=list(SPELLINGS))
    ap.add_argument("--check", action="store_true", help="small CPU check: rewritten and equal to eager")
    ap.add_argument("--fake", action="store_true", help="B=128, N=4096 static under fake tensors (CPU)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--embedding", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep time in ms")
    ap.add_argument("--host", action="store_true", help="also the host time per step, the GPU stalled")
    ap.add_argument("--cprofile", action="store_true", help="with --host: a cProfile of 8 steps per model")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "out")))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.check:
        sys.exit(0 if check(args.spelling) else 1)
    if args.fake:
        return fake(args.spelling)
    bench(args.spelling, args)


if __name__ == "__main__":
    main()

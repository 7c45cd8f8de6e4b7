"""Benchmark jagged HSTU attention: eager reference, stock Inductor, the ``hstu`` backend, our kernels.

Grid (defaults): B=128, H=4, Dq=Dv=128, N in {512, 1024, 2048, 4096}, lengths ~ U[0.9N, N),
1..20 targets per sequence, alpha = 1/Dq, bf16, fwd and bwd. FLOPs (HSTU_SEMANTICS.md):
fwd = sum_b H n_b^2 (Dq + Dv), bwd = sum_b H n_b^2 (3 Dq + 2 Dv). Times are
``triton.testing.do_bench`` medians.

    python benchmarks/attention.py --n 1024 2048 --providers triton_tma triton_ptr --out OUTDIR

Writes ``attention.csv`` and ``attention.png`` under ``--out`` (default ``$OUT`` or benchmarks/out).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import csv
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# triton_auto: tma=None, deterministic=False (what callers get by default); triton_tma / triton_ptr force the
# descriptor / pointer variants; triton_tma_det: deterministic=True.
STATIC = False  # --static: compile the hstu_backend provider with dynamic=False

PROVIDERS = ["eager", "inductor", "hstu_backend", "hstu_op", "triton_auto", "triton_tma", "triton_ptr", "triton_tma_det"]
# The anchor (issue 12): generative-recommenders' Triton kernels, TMA and pointer variants, imported from
# a copy of its repository that is not part of this project (HSTU_ANCHOR_PATH, default ./.anchor; see
# benchmarks/README or RESULTS.md for how it is made). They get contiguous q/k/v (their TMA path needs it).
ANCHORS = ["gr_tma", "gr"]


def _anchor():
    root = os.environ.get("HSTU_ANCHOR_PATH", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                           ".anchor"))
    if root not in sys.path:
        sys.path.insert(0, root)
    from generative_recommenders.ops.triton import triton_hstu_attention as gr

    return gr


def make_inputs(B, N, H, Dq, Dv, dtype, device, seed=0, layout="fused"):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.9 * N), N, (B,), generator=g)
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    L = int(offsets[-1])
    num_targets = torch.randint(1, 21, (B,), generator=g)
    # fused: q, k, v as strided views of one fused projection output, as in an STU layer;
    # contig: three contiguous [L, H, D] tensors
    fused = torch.randn(L, H * (2 * Dv + 2 * Dq), device=device, dtype=dtype)
    v = fused[:, H * Dv:2 * H * Dv].view(L, H, Dv)
    q = fused[:, 2 * H * Dv:2 * H * Dv + H * Dq].view(L, H, Dq)
    k = fused[:, 2 * H * Dv + H * Dq:].view(L, H, Dq)
    if layout == "contig":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        del fused
    return q, k, v, offsets.to(device), num_targets.to(device), lengths


def flops(lengths, H, Dq, Dv):
    s = float((lengths.double() ** 2).sum())
    return H * s * (Dq + Dv), H * s * (3 * Dq + 2 * Dv)


def bench(fn, rep_ms):
    if not torch.cuda.is_available():  # CPU dry run (TRITON_INTERPRET=1): one timed call
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")


def build_provider(name, N, alpha, num_targets):
    """Return (fwd(q,k,v,off) -> out, bwd(q,k,v,off,dout) or None) for a provider."""
    from hstu_inductor.reference import hstu_mha

    def ref(q, k, v, off):
        return hstu_mha(N, alpha, q, k, v, off, causal=True, dropout_pr=0.0, training=True, num_targets=num_targets)

    if name in ("eager", "inductor", "hstu_backend"):
        # the timed backward re-runs one graph (retain_graph=True); donated buffers forbid that
        torch._functorch.config.donated_buffer = False
        # Fresh compile caches per N: otherwise the recompile for a new N makes Dynamo treat the
        # captured max length as a SymInt, and a symbolic N is not proven (a model has one N).
        torch._dynamo.reset()
        if name == "eager":
            fn = ref
        elif name == "inductor":
            fn = torch.compile(ref, dynamic=False)
        else:
            import hstu_inductor  # noqa: F401  (registers backend="hstu")

            def ref_nt(q, k, v, off, nt):
                return hstu_mha(N, alpha, q, k, v, off, causal=True, dropout_pr=0.0, training=True, num_targets=nt)

            from hstu_inductor.report import collecting

            compiled = torch.compile(ref_nt, backend="hstu", dynamic=False if STATIC else None)
            first = [True]

            def fn(q, k, v, off):
                # Dynamic L and B, as a real model sees them after its first recompile; --static: the
                # first, static compile (proven by value at its sizes, patterns/attn_meaning.py)
                if not STATIC:
                    for t in (q, k, v, off, num_targets):
                        torch._dynamo.maybe_mark_dynamic(t, 0)
                if not first[0]:
                    return compiled(q, k, v, off, num_targets)
                first[0] = False
                with collecting() as report, _gluon_spy() as gluon:
                    out = compiled(q, k, v, off, num_targets)
                print(f"hstu_backend N={N}: first call ran {_kernel_names(gluon)}", flush=True)
                # a backend that silently fell back to stock Inductor would be timed as "ours"
                if report.counts.get("attention", 0) != 1:
                    print(report, flush=True)
                    raise RuntimeError("backend=hstu did not rewrite the attention (report above)")
                return out

        def fwd(q, k, v, off):
            with torch.no_grad():
                return fn(q, k, v, off)

        def make_bwd(q, k, v, off, dout):
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out = fn(qq, kk, vv, off)
            return lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True)

        return fwd, make_bwd

    if name in ANCHORS:
        gr = _anchor()
        gr_tma = name == "gr_tma"

        def gfwd(q, k, v, off):
            q, k, v = (t.contiguous() for t in (q, k, v))  # no copy for contiguous inputs
            return gr.triton_hstu_attention_fwd(N, alpha, q, k, v, off, num_targets, 0, 0, None, gr_tma, 0)

        def gmake_bwd(q, k, v, off, dout):
            q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

            def step():
                gr.triton_hstu_attention_bwd(dout, q, k, v, dq, dk, dv, off, num_targets, N, alpha, 0, 0, None,
                                             gr_tma, 0)
                return dq, dk, dv

            return step

        return gfwd, gmake_bwd

    if name == "hstu_op":  # the registered op, eager (Gluon where in scope, else the Triton kernels)
        import hstu_inductor  # noqa: F401

        def ofwd(q, k, v, off):
            with _gluon_spy() as gluon:
                out = torch.ops.hstu.attention(q, k, v, off, N, alpha, num_targets)
            if not _seen_op[0]:
                _seen_op[0] = True
                from hstu_inductor.ops import variants
                print(f"hstu_op N={N}: forward ran {_kernel_names(gluon)} (variant {variants.chosen('fwd')})",
                      flush=True)
            return out

        def omake_bwd(q, k, v, off, dout):
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out = torch.ops.hstu.attention(qq, kk, vv, off, N, alpha, num_targets)
            return lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True)

        _seen_op[0] = False
        return ofwd, omake_bwd

    from hstu_inductor.kernels import attention as K

    tma = {"triton_auto": None, "triton_ptr": False}.get(name, True)
    det = name.endswith("_det")

    def kfwd(q, k, v, off):
        return K.hstu_attention_fwd(q, k, v, off, N, alpha, num_targets=num_targets, tma=tma)

    def kmake_bwd(q, k, v, off, dout):
        return lambda: K.hstu_attention_bwd(dout, q, k, v, off, N, alpha, num_targets=num_targets, tma=tma,
                                            deterministic=det)

    return kfwd, kmake_bwd


_seen_op = [False]


@contextlib.contextmanager
def _gluon_spy():
    """Count calls of the Gluon kernels' entry points (forward, and backward where it exists), so the
    table says which kernel a provider really ran."""
    calls = {}
    patched = []
    for mod_name, fn_name in (("gluon_attention", "gluon_forward"), ("gluon_backward", "gluon_backward")):
        try:
            mod = importlib.import_module(f"hstu_inductor.kernels.{mod_name}")
        except Exception:  # no Gluon in this Triton, or no such kernel yet
            continue
        real = getattr(mod, fn_name)

        def counting(*a, _real=real, _n=fn_name, **kw):
            calls[_n] = calls.get(_n, 0) + 1
            return _real(*a, **kw)

        setattr(mod, fn_name, counting)
        patched.append((mod, fn_name, real))
    try:
        yield calls
    finally:
        for mod, fn_name, real in patched:
            setattr(mod, fn_name, real)


def _kernel_names(calls):
    return ", ".join(f"{k} x{v}" for k, v in calls.items()) or "the Triton kernels only"


def reference_fwd(q, k, v, off, nt, N, alpha, rows_per_chunk=2 ** 16):
    """The fp32 eager reference, a few sequences at a time (the padded score tensor of a whole
    B=128, N=4096 batch would need 32 GB)."""
    from hstu_inductor.reference import hstu_mha

    B = off.numel() - 1
    per = max(1, rows_per_chunk // N)
    outs = []
    for b0 in range(0, B, per):
        b1 = min(B, b0 + per)
        r0, r1 = int(off[b0]), int(off[b1])
        outs.append(hstu_mha(N, alpha, *(t[r0:r1].float() for t in (q, k, v)), off[b0:b1 + 1] - r0, causal=True,
                             num_targets=nt[b0:b1]))
    return torch.cat(outs)


def _tuners():
    try:
        from hstu_inductor.kernels import attention as K
    except Exception:
        return {}
    return K._TUNERS


def _tuner_state():
    return {name: set(getattr(t, "cache", {})) for name, t in _tuners().items()}


def _fmt_cfg(c):
    kw = c.kwargs
    s = f"{kw.get('BLOCK_M')}x{kw.get('BLOCK_N')}w{c.num_warps}s{c.num_stages}"
    return s + (f"r{c.maxnreg}" if getattr(c, "maxnreg", None) else "")


def autotune_delta(before, label):
    """Lines describing autotuning that happened since ``before`` (per-config median ms)."""
    lines = []
    for name, t in _tuners().items():
        new = set(getattr(t, "cache", {})) - before.get(name, set())
        if not new:
            continue
        timings = getattr(t, "configs_timings", None) or {}
        ranked = sorted(timings.items(), key=lambda x: x[1][0] if isinstance(x[1], (list, tuple)) else x[1])
        cells = " ".join(f"{_fmt_cfg(c)}={(tm[0] if isinstance(tm, (list, tuple)) else tm):.3f}" for c, tm in ranked)
        lines.append(f"  tune {label} {name}: {cells}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS + ANCHORS)
    ap.add_argument("--layout", default="fused", choices=["fused", "contig"],
                    help="q/k/v: views of one fused projection (default) or contiguous tensors")
    ap.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dq", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--max-n-baseline", type=int, default=2048,
                    help="skip eager/inductor/hstu_backend above this N (memory/time)")
    ap.add_argument("--min-n-baseline", type=int, default=0, help="skip baselines below this N")
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep time in ms")
    ap.add_argument("--check", action="store_true", help="compare kernel outputs with eager at each N")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "out")))
    ap.add_argument("--tag", default="", help="label added to the CSV rows")
    ap.add_argument("--static", action="store_true", help="hstu_backend: static shapes (dynamic=False)")
    args = ap.parse_args()
    global STATIC
    STATIC = args.static

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    H, Dq, Dv, B = args.heads, args.dq, args.dv, args.batch
    alpha = 1.0 / Dq
    from hstu_inductor import config
    os.makedirs(args.out, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}  torch {torch.__version__}  "
          f"triton {__import__('triton').__version__}  B={B} H={H} Dq={Dq} Dv={Dv} {args.dtype} layout={args.layout} "
          f"tile order={config.tile_order}", flush=True)
    rows = []
    for N in args.n:
        q, k, v, off, nt, lengths = make_inputs(B, N, H, Dq, Dv, dtype, device, seed=N, layout=args.layout)
        f_fwd, f_bwd = flops(lengths, H, Dq, Dv)
        dout = torch.randn(q.shape[0], H, Dv, device=device, dtype=dtype)
        ref_out = None
        ref_grads = None
        for prov in args.providers:
            baseline = prov in ("eager", "inductor", "hstu_backend")
            for mode in args.modes:
                row = dict(tag=args.tag, N=N, provider=prov, mode=mode, ms=float("nan"), tflops=float("nan"),
                           note="")
                if baseline and (N > args.max_n_baseline or N < args.min_n_baseline):
                    row["note"] = "skipped"
                    rows.append(row)
                    continue
                try:
                    t0 = time.time()
                    tstate = _tuner_state()
                    fwd, make_bwd = build_provider(prov, N, alpha, nt)
                    if mode == "fwd":
                        out = fwd(q, k, v, off)
                        if args.check and not baseline:
                            if ref_out is None:
                                ref_out = reference_fwd(q, k, v, off, nt, N, alpha)
                            err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
                            row["note"] = f"rel_err={err:.2e}"
                        del out
                        ms = bench(lambda: fwd(q, k, v, off), args.rep)
                        fl = f_fwd
                    else:
                        step = make_bwd(q, k, v, off, dout)
                        with _gluon_spy() as gluon:
                            got = step()
                        if prov in ("hstu_backend", "hstu_op"):  # which backward the timed step runs
                            from hstu_inductor.ops import variants
                            print(f"{prov} N={N}: first backward ran {_kernel_names(gluon)} "
                                  f"(variant {variants.chosen('bwd')})", flush=True)
                        if args.check and not baseline:
                            # against an independent dQ computation: the deterministic split kernels, or
                            # (for the deterministic provider itself) the atomic kernel
                            if prov == "triton_tma_det":
                                with config.patch(bwd_algo="atomic"):
                                    other = build_provider("triton_ptr", N, alpha, nt)[1](q, k, v, off, dout)()
                            else:
                                if ref_grads is None:
                                    ref_grads = build_provider("triton_tma_det", N, alpha, nt)[1](
                                        q, k, v, off, dout)()
                                other = ref_grads
                            errs = [((g.float() - r.float()).norm() / r.float().norm()).item()
                                    for g, r in zip(got, other)]
                            row["note"] = "rel_err dq/dk/dv vs other algo=" + "/".join(f"{e:.1e}" for e in errs)
                            del other
                        del got
                        ms = bench(step, args.rep)
                        fl = f_bwd
                        del step
                    row.update(ms=ms, tflops=fl / (ms * 1e-3) / 1e12)
                    print(f"  N={N:5d} {prov:14s} {mode}: {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s "
                          f"({time.time() - t0:.0f}s incl. compile/tune) {row['note']}", flush=True)
                    for line in autotune_delta(tstate, f"N={N} {prov} {mode}"):
                        print(line, flush=True)
                except Exception as e:  # a provider failing (OOM, backend missing) reports n/a
                    row["note"] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                    print(f"  N={N:5d} {prov:14s} {mode}: {row['note']}", flush=True)
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
                    if device == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
        del q, k, v, dout, ref_out, ref_grads
        if device == "cuda":
            torch.cuda.empty_cache()

    csv_path = os.path.join(args.out, f"attention{args.tag and '_' + args.tag}.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)

    # table: rows = provider/mode, columns = N
    print("\nTFLOP/s (ms) — " + f"B={B} H={H} Dq={Dq} Dv={Dv} {args.dtype}, lengths U[0.9N,N), 1-20 targets")
    hdr = f"{'provider':16s} {'mode':4s} " + " ".join(f"{'N=' + str(n):>18s}" for n in args.n)
    print(hdr)
    for prov in args.providers:
        for mode in args.modes:
            cells = []
            for n in args.n:
                r = next((r for r in rows if r["provider"] == prov and r["mode"] == mode and r["N"] == n), None)
                if r is None or math.isnan(r["ms"]):
                    cells.append(f"{'n/a' if r is None or r['note'] != 'skipped' else 'skipped':>18s}")
                else:
                    cells.append(f"{r['tflops']:7.1f} ({r['ms']:7.3f})")
            print(f"{prov:16s} {mode:4s} " + " ".join(cells))

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(args.modes), figsize=(6 * len(args.modes), 4), squeeze=False)
        for ax, mode in zip(axes[0], args.modes):
            for prov in args.providers:
                xs = [r["N"] for r in rows if r["provider"] == prov and r["mode"] == mode and not math.isnan(r["ms"])]
                ys = [r["tflops"] for r in rows if r["provider"] == prov and r["mode"] == mode
                      and not math.isnan(r["ms"])]
                if xs:
                    ax.plot(xs, ys, marker="o", label=prov)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max_seq_len N")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"HSTU attention {mode} ({args.dtype}, B={B}, H={H}, D={Dq})")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"attention{args.tag and '_' + args.tag}.png"), dpi=110)
    except Exception as e:  # pragma: no cover
        print(f"plot skipped: {e}")
    print(f"wrote {csv_path}")


if __name__ == "__main__":
    main()

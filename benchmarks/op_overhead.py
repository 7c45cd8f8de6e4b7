"""Host time of one direct ``torch.ops.hstu.attention`` call (eager), issue 22 item 5 (target: <= 60 us
with input checks on).

    PYTHONPATH=$PWD HSTU_INDUCTOR_AUTOTUNE=0 python benchmarks/op_overhead.py --out OUTDIR   # CUDA
    PYTHONPATH=$PWD python benchmarks/op_overhead.py --cpu-python                           # CPU, see below

How: the stream is stalled with ``torch.cuda._sleep`` long enough that no call waits for the GPU,
then ``--calls`` op calls are timed with ``perf_counter`` (no sync inside), so the time per call is
the host's alone: dispatch, validation, the value checks' launches, the Triton launcher. The median
and the minimum over ``--reps`` repetitions are reported, with the GPU time per call (CUDA events,
no stall) beside it. Inputs: bf16, H=4, D=128, lengths ~ U[0.9N, N], <= 20 targets per sequence.

Modes (``config.check_inputs`` and how the checks are spelled):
- ``off``: no value checks;
- ``auto``: the default, one fused check kernel per eager call (``kernels/checks.py``);
- ``auto_aten``: ``auto`` with the ATen spelling that compiled graphs keep (~15 small launches; the
  eager path before the fused check), for comparison in the same run.
Breakdown rows (``part``): ``op`` (the whole call), ``kernel_fn`` (``kernels.attention.hstu_attention_fwd``
alone: allocation and the Triton launcher), ``checks`` (``check_jagged_values`` alone), and with
``--compiled`` ``compiled`` (the plain reference attention under ``torch.compile(backend="hstu")``, static
shapes, inference: guards, the compiled wrapper and the rewritten op together), ``gluon_fn`` / ``gluon_bwd_fn``
(the Gluon forward's / backward's host function alone, sm90, cached launches: ``kernels/fastlaunch.py``),
``gluon_fn_uncached`` / ``gluon_bwd_fn_uncached`` (the same through Triton's ``kernel[grid]``, the cache off),
``op_uncached`` (the whole op, checks on, the cache off) and ``empty_op`` (a custom op that only allocates: the
dispatch floor).

``--cpu-python``: without a GPU, the Python part of the op's CUDA branch on CPU tensors with every
launch stubbed out (dispatch, validation, launch-argument set-up; no checks, no launcher), with the
fast validation of plain calls on and off. Writes ``op_overhead.csv`` (``op_overhead_cpu.csv``).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import host_us, sleep_cycles_per_ms, write_csv  # noqa: E402

log = logging.getLogger("op_overhead")
H, D, ALPHA = 4, 128, 1.0 / 128


def inputs(B, N, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.9 * N), N + 1, (B,), generator=g)
    off = torch.zeros(B + 1, dtype=torch.int64)
    off[1:] = lengths.cumsum(0)
    L = int(off[-1])
    q, k, v = (torch.randn(L, H, D, generator=g).to(device, torch.bfloat16) for _ in range(3))
    nt = torch.minimum(torch.randint(0, 21, (B,), generator=g), lengths)
    return q, k, v, off.to(device), N, nt.to(device)


def op_call(q, k, v, off, N, nt):
    return torch.ops.hstu.attention(q, k, v, off, N, ALPHA, nt, None, 0, 0, 0, True)


def gpu_us(fn, calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def compiled_call(q, k, v, off, N, nt):
    """A no-grad call of the plain reference attention compiled with ``backend="hstu"`` (static shapes);
    raises if the attention was not rewritten (a stock-Inductor time would be misread as ours)."""
    from hstu_inductor.reference import hstu_mha
    from hstu_inductor.report import collecting

    fn = torch.compile(lambda *a: hstu_mha(N, ALPHA, *a, num_targets=nt), backend="hstu", dynamic=False)
    with torch.no_grad(), collecting() as report:
        fn(q, k, v, off)
    if report.counts.get("attention", 0) != 1:
        raise RuntimeError(f"backend=hstu did not rewrite the attention:\n{report}")

    def call():
        with torch.no_grad():
            return fn(q, k, v, off)
    return call


@torch.library.custom_op("hstu_bench::empty", mutates_args=())
def _empty_op(q: torch.Tensor) -> torch.Tensor:
    """The floor of any custom op's dispatch: an op that only allocates an empty tensor."""
    return q.new_empty(0)


def gluon_fn(q, k, v, off, N, nt, backward=False):
    """The Gluon forward's (backward's) host function alone (a no-op where it does not apply)."""
    from hstu_inductor.ops import _gluon

    mod = _gluon._bwd_module() if backward else _gluon._module()
    if mod is None or not mod.gluon_supported(q.device):
        return lambda: None
    if backward:
        grad = torch.randn_like(q)
        return lambda: mod.gluon_backward(grad, q, k, v, off, N, ALPHA, nt, checked=True)
    return lambda: mod.gluon_forward(q, k, v, off, N, ALPHA, nt, checked=True)


def uncached(fn):
    """``fn`` with the cached launch path of the Gluon kernels off (``config.fastlaunch``)."""
    from hstu_inductor import config

    def call():
        with config.patch(fastlaunch="off"):
            return fn()
    return call


# parts timed in the default checks mode only (compiled graphs keep their own checks; the rest has none)
ONE_ROW = ("compiled", "gluon_fn", "gluon_fn_uncached", "gluon_bwd_fn", "gluon_bwd_fn_uncached", "op_uncached",
           "empty_op")


def run_cuda(args):
    import hstu_inductor
    from hstu_inductor.kernels import attention as K

    checks = importlib.import_module("hstu_inductor.ops._checks")
    modes = {"off": ("off", True), "auto": ("auto", True), "auto_aten": ("auto", False)}
    stall = int(args.stall_ms * sleep_cycles_per_ms())
    rows = []
    for N in args.n:
        for B in args.batch:
            x = inputs(B, N, "cuda")
            q, k, v, off, _, nt = x
            parts = {"op": lambda: op_call(*x),
                     "kernel_fn": lambda: K.hstu_attention_fwd(q, k, v, off, N, ALPHA, nt),
                     "checks": lambda: checks.check_jagged_values(off, q.shape[0], N, nt)}
            if args.compiled:
                torch._dynamo.reset()
                parts["compiled"] = compiled_call(*x)
                parts["gluon_fn"] = gluon_fn(*x)
                parts["gluon_fn_uncached"] = uncached(parts["gluon_fn"])
                parts["gluon_bwd_fn"] = gluon_fn(*x, backward=True)
                parts["gluon_bwd_fn_uncached"] = uncached(parts["gluon_bwd_fn"])
                parts["op_uncached"] = uncached(parts["op"])
                parts["empty_op"] = lambda: torch.ops.hstu_bench.empty(q)
            for mode, (check_inputs, fused) in modes.items():
                with hstu_inductor.config.patch(check_inputs=check_inputs), \
                        mock.patch.object(checks, "_fused_ok", checks._fused_ok if fused else lambda *a: False):
                    for part, fn in parts.items():
                        if part == "kernel_fn" and mode != "off":
                            continue  # no checks in it: one row is enough
                        if part == "checks" and mode == "off":
                            continue
                        if part in ONE_ROW and mode != "auto":
                            continue  # compiled graphs keep their own checks: one row
                        for _ in range(3):  # warm up: Triton compiles, caches
                            fn()
                        med, best, covered = host_us(fn, args.calls, args.reps, stall)
                        dev = gpu_us(fn, args.calls)
                        rows.append(dict(device=torch.cuda.get_device_name(), N=N, B=B, L=q.shape[0], mode=mode,
                                         part=part, host_us_median=round(med, 1), host_us_min=round(best, 1),
                                         gpu_us=round(dev, 1), gpu_still_busy=covered))
                        log.info("N=%5d B=%4d %-9s %-9s host %7.1f us (min %7.1f)  gpu %8.1f us  busy %.2f", N, B,
                                 mode, part, med, best, dev, covered)
    write_csv(rows, args.out, "op_overhead.csv")


def run_profile(args):
    """cProfile of plain eager op calls (checks on, GPU stalled so the host never waits): where the host
    time of one call goes, by function (``op_overhead_profile.txt`` under ``--out``)."""
    import hstu_inductor  # noqa: F401  (registers the ops)
    import cProfile
    import io
    import pstats

    stall = int(args.stall_ms * sleep_cycles_per_ms())
    x = inputs(args.batch[0], args.n[0], "cuda")
    call = compiled_call(*x) if args.compiled else (lambda: op_call(*x))
    what = "the compiled plain attention" if args.compiled else "hstu::attention"
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as tprof:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
    table = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    prof = cProfile.Profile()
    calls = 0
    for _ in range(args.reps):
        torch.cuda._sleep(stall)
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
        calls += args.calls
        torch.cuda.synchronize()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    buf.write(f"torch.profiler, 10 calls of {what}:\n{table}\n")
    buf.write(f"{calls} calls of {what} (N={args.n[0]}, B={args.batch[0]}); times are totals\n")
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(35)
    os.makedirs(args.out, exist_ok=True)
    name = "compiled_overhead_profile.txt" if args.compiled else "op_overhead_profile.txt"
    with open(os.path.join(args.out, name), "w") as f:
        f.write(buf.getvalue())
    print(buf.getvalue()[:6000])


def run_cpu_python(args):
    """The op's CUDA branch on CPU tensors with launches stubbed (module doc)."""
    import hstu_inductor
    from hstu_inductor.kernels import attention as K

    ops_attention = importlib.import_module("hstu_inductor.ops.attention")
    fast = ops_attention._plain_inputs_ok
    rows = []
    with hstu_inductor.config.patch(check_inputs="off"), mock.patch.object(K, "_launch", lambda *a, **k: None), \
            mock.patch.object(importlib.import_module("hstu_inductor.ops._kernels"), "kernels_for", lambda t: K):
        for N in args.n:
            for B in args.batch:
                x = inputs(B, N, "cpu")
                for validation, ok in (("fast", fast), ("full", lambda *a: False)):
                    with mock.patch.object(ops_attention, "_plain_inputs_ok", ok):
                        for _ in range(100):
                            op_call(*x)
                        times = []
                        for _ in range(args.reps):
                            t0 = time.perf_counter()
                            for _ in range(args.calls):
                                op_call(*x)
                            times.append((time.perf_counter() - t0) / args.calls * 1e6)
                    med, best = statistics.median(times), min(times)
                    rows.append(dict(device="cpu (launches stubbed)", N=N, B=B, validation=validation,
                                     host_us_median=round(med, 1), host_us_min=round(best, 1)))
                    log.info("N=%5d B=%4d validation %-4s host %6.1f us (min %6.1f)", N, B, validation, med, best)
    write_csv(rows, args.out, "op_overhead_cpu.csv")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 128])
    ap.add_argument("--calls", type=int, default=30, help="calls per timing (<= ~50: the launch queue must not fill)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--stall-ms", type=float, default=50.0, help="GPU stall covering one timing's host loop")
    ap.add_argument("--cpu-python", action="store_true", help="no GPU: the Python part only, launches stubbed")
    ap.add_argument("--profile", action="store_true", help="cProfile of op calls at the first --n / --batch")
    ap.add_argument("--compiled", action="store_true",
                    help="also time (with --profile: profile) the plain attention compiled with backend='hstu'")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "out")))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cpu_python:
        return run_cpu_python(args)
    if not torch.cuda.is_available():
        ap.error("needs CUDA (or --cpu-python)")
    if args.profile:
        return run_profile(args)
    run_cuda(args)


if __name__ == "__main__":
    main()

"""Where a small compiled step's time goes: wall, host and GPU time per step of stock Inductor and
``backend="hstu"`` on ``reference.STULayer`` (inference), with the kernels the profiler saw.

    python benchmarks/cudagraph_step.py [--sizes 2x1024 4x256] [--modes reduce-overhead default]

Per (B x N, mode, provider), one ``dynamic=True`` compile, then:

- ``wall``: mean time per step of 50 steps between two synchronisations (median of 5);
- ``host``: mean time per step of 20 steps issued while the GPU is stalled by ``torch.cuda._sleep``
  (the host's own time: guards, CUDA-graph replay bookkeeping, input copies, launches);
- ``gpu``: the profiler's CUDA time per step (10 steps), and its six largest kernels with their counts
  per step (``Memcpy DtoD`` rows are CUDA graphs copying inputs into their static buffers).

E=512, H=4, D=128, bf16, lengths ~ U[0.9N, N], 1..20 targets (as ``never_slower.py``). Needs CUDA.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from never_slower_models import input_seed, make_batch  # noqa: E402  (the same batches as never_slower.py)


def measure(f, args, mode):
    def step():
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            return f(*args)

    for _ in range(4):  # compile, CUDA-graph warm-up and recording
        step()
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) / 50 * 1e6)
        torch.cuda._sleep(int(2e8))
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        hosts.append((time.perf_counter() - t0) / 20 * 1e6)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.key_averages() if e.device_type.name == "CUDA"), key=lambda e: -e.device_time_total)
    gpu = sum(e.device_time_total for e in kernels) / 10
    top = "; ".join(f"{e.key[:40]} {e.device_time_total / 10:.1f} us x{e.count // 10}" for e in kernels[:6])
    return statistics.median(walls), statistics.median(hosts), gpu, top


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["2x1024", "4x256"], help="BxN")
    p.add_argument("--modes", nargs="+", default=["reduce-overhead"], choices=["reduce-overhead", "default"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cudagraph_step.py times CUDA steps: it needs a GPU")
    import hstu_inductor  # noqa: F401  (registers backend="hstu")
    from hstu_inductor.reference import STULayer
    from hstu_inductor.report import collecting

    E, H, D = 512, 4, 128
    torch.manual_seed(0)
    layer = STULayer(E, H, D, D).to("cuda", torch.bfloat16).eval()
    for size in args.sizes:
        B, N = (int(x) for x in size.split("x"))
        x, off, nt = make_batch(B, N, E, seed=input_seed(B, N))
        for mode in args.modes:
            for prov in ("inductor", "hstu"):
                torch._dynamo.reset()
                kw = dict(mode=None if mode == "default" else mode, dynamic=True)
                f = torch.compile(layer, **kw) if prov == "inductor" else torch.compile(layer, backend="hstu", **kw)
                with collecting() as report:
                    wall, host, gpu, top = measure(f, (x, off, N, nt), mode)
                print(f"B={B} N={N} {mode} {prov:8s} wall {wall:7.1f} us  host {host:7.1f} us  gpu {gpu:7.1f} us  "
                      f"rewrites {dict(report.counts)}")
                print(f"    {top}")


if __name__ == "__main__":
    main()

"""Shared by the benchmark scripts: where their result rows go, the peak memory of a step, host time per call."""
from __future__ import annotations

import csv
import logging
import os
import statistics
import time


def write_csv(rows: list, out: str, name: str) -> str:
    """Write ``rows`` (dicts with the same keys) to ``out/name`` and log the path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    logging.getLogger("hstu_inductor.benchmarks").info("wrote %s", path)
    return path


def peak_mib(step) -> tuple:
    """(MiB allocated by one call of ``step`` above what was allocated before it, absolute peak MiB): the
    memory the step itself needs (e.g. N x N buffers), and with its inputs. CUDA; ``step`` already warmed up."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return (peak - base) / 2 ** 20, peak / 2 ** 20


def layer_args(ap, batch: int = 32, n: int = 1024) -> None:
    """The sizes, timing and output options of the layer benchmarks (B, N, E, H, D, do_bench rep, out dir)."""
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--n", type=int, default=n)
    ap.add_argument("--embedding", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rep", type=int, default=200, help="do_bench rep time in ms")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "out")))


def compiled_with_counts(model, inputs, backend: str):
    """(``torch.compile(model, backend=backend)``, "attention/preprocess/output" rewrite counts or "" for stock
    Inductor) from a fresh Dynamo: the counts from ``explain`` on the eager backend, then a reset, so the
    compiled model's first call is its own first compile."""
    import torch

    import hstu_inductor

    torch._dynamo.reset()
    counts = ""
    if backend == "hstu":
        rep = hstu_inductor.explain(model, *inputs, backend="hstu_eager")
        counts = "/".join(str(rep.counts[k]) for k in ("attention", "preprocess", "output"))
        if rep.near_misses:
            logging.getLogger("hstu_inductor.benchmarks").info("near misses: %s", rep.near_misses)
        torch._dynamo.reset()
    return torch.compile(model, backend=backend), counts


def sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` spins for a number of GPU clock cycles: calibrate them once."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def host_us(fn, calls, reps, stall_cycles):
    """Median and min host microseconds per call of ``fn`` while the stream is stalled by ``stall_cycles`` of
    ``torch.cuda._sleep`` (so no call waits for the GPU: the time is the host's alone), and the fraction of
    timings after which the stream was still busy (1.0: the stall covered every call)."""
    import torch

    times, covered = [], 0
    stream = torch.cuda.current_stream()
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(stall_cycles)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        covered += not stream.query()
    torch.cuda.synchronize()
    return statistics.median(times), min(times), covered / reps


def kernel_profile(step, steps=10) -> tuple:
    """(GPU ms of one step, [(kernel, ms per step)] the largest first): the sum of its kernels' durations
    (torch.profiler), what the step would take if the host never held the GPU up, and where it goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per = [(e.key, (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0))
            / steps / 1000) for e in prof.key_averages()]
    per.sort(key=lambda kv: -kv[1])
    return sum(ms for _, ms in per), per


def kernel_ms(step, steps=10) -> float:
    """GPU time of one step (:func:`kernel_profile`)."""
    return kernel_profile(step, steps)[0]


def top_kernels(per: list, top: int = 8) -> str:
    """``name ms; ...`` of :func:`kernel_profile`'s largest kernels."""
    return "; ".join(f"{name[:48]} {ms:.3f} ms" for name, ms in per[:top])


def host_ms(step) -> float:
    """Host time of one step with the GPU stalled (:func:`host_us`, median, 4 steps per timing): above the
    kernel time, the step is bound by the host."""
    return host_us(step, 4, 10, int(100 * sleep_cycles_per_ms()))[0] / 1000

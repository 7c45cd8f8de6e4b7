"""Which arguments torch's mutation analysis of user Triton kernels thinks each attention kernel writes.

    .venv/bin/python scripts/mutation_analysis.py [pos+ts|pos|ts[:split|atomic[:inkernel]] ...]  (default pos+ts:split)

torch.compile / AOTAutograd functionalize a ``wrap_triton`` launch by the tensors this analysis
(``torch._higher_order_ops.triton_kernel_wrap.identify_accessed_tensors``, on the kernel's TTIR) reports as
written, and copy them back into the inputs: an input it wrongly reports (a table requiring grad) fails the
compile ("a leaf Variable that requires grad is being used in an in-place operation"). The analysis follows
an address back through every argument of a helper call whose result feeds it, so a helper that received
an input pointer taints it; torch 2.11 also follows loads (the jagged offsets and num_targets that bound
the query blocks: common.address_source gives traced launches private copies). Needs no GPU: the TTIR is
generated for sm90. Prints one line per case and kernel (``CASE KERNEL writes: ...``).
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


class _Sm90:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 128)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _Record:
    """``kernel[grid](*args, **kwargs)`` recorded as (kind, args, kwargs) instead of launched."""

    def __init__(self, launches, kind, args):
        self.launches, self.kind = launches, kind

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kind, args, kwargs))


def main(*cases):
    """Each case ``TABLES[:ALGO[:inkernel]]``: the tables, the backward's ``config.bwd_algo`` (split: the dQ
    kernel; atomic: dQ in the dK/dV kernel), and ``inkernel``: the table gradients summed in the dK/dV kernel
    (``config.table_grad_mb = 0``), not through the dense buffer (kernels/table_grad.py). One process for all
    (its imports are most of the time)."""
    triton.runtime.driver.set_active(_Sm90())
    for case in cases or ("pos+ts:split",):
        which, algo, where = (case.split(":") + ["", ""])[:3]
        _case(case, which, algo or "split", where == "inkernel")


def _case(case, which, algo, inkernel=False):
    from torch._higher_order_ops import triton_kernel_wrap as W

    from hstu_inductor import config
    from hstu_inductor.kernels import attention as K
    from hstu_inductor.kernels import bucket_map as BM
    from hstu_inductor.kernels import table_grad as TG

    config.bwd_algo = algo
    config.table_grad_mb = 0 if inkernel else 4096
    launches = []
    K._launch = lambda kind, grid_rows, grid_x, block_d, args, kwargs, **kw: launches.append((kind, args, kwargs))
    K._launcher = lambda kern, args: _NoLaunch()  # the dQ finalize kernel (atomic): no TTIR of interest
    # the time-bucket map (kernels/bucket_map.py), which the attention kernels then read in place of timestamps
    BM.launcher = lambda kern, args: _Record(launches, "bucket_map", args)
    TG.launcher = lambda kern, args: _Record(launches, "table_grad", args)  # the dense gradient's reduction
    L, H, D, N = 20, 2, 16, 16
    q, k, v, do = (torch.randn(L, H, D) for _ in range(4))
    off = torch.tensor([0, 8, 20])
    ts = torch.randint(0, 1000, (L,))
    pos_w = torch.randn(2 * N - 1) if "pos" in which else None
    ts_w = torch.randn(9) if "ts" in which else None
    tkw = dict(timestamps=ts if ts_w is not None else None, pos_w=pos_w, ts_w=ts_w)
    nt = torch.tensor([2, 3])
    K.hstu_attention_fwd(q, k, v, off, N, 0.1, nt, **tkw)
    K.hstu_attention_bwd(do, q, k, v, off, N, 0.1, nt, table_grad=True, **tkw)
    for kind, args, kwargs in launches:
        fn = {"bucket_map": BM._bucket_map_kernel, "table_grad": TG._table_grad_kernel}.get(kind) or K._JIT[kind]
        kw = dict(zip(fn.arg_names, args))
        if kind in K._JIT:
            kw.update({f: False for f in K._OPTIONAL_FLAGS[kind]})
            kw.update(K._cfg(kind, *K._GPU_CONFIGS[(kind, "fp32")][0]).kwargs)
        kw.update(kwargs)
        if hasattr(W, "identify_accessed_tensors"):
            writes = [d.name for d in W.identify_accessed_tensors(fn, kw, {}).read_writes.writes]
        else:  # torch 2.11: the names only (a failed analysis logs its exception and reports every input)
            writes = list(W.identify_mutated_tensors(fn, kw, {}))
        print(case, kind, "writes:", " ".join(writes))


if __name__ == "__main__":
    main(*sys.argv[1:])

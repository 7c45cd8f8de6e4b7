#!/usr/bin/env python
"""Proof time of one attention candidate as the sizes grow: the value-level prover reads one element
at symbolic coordinates, so B, H, D and N should not move it.

    .venv/bin/python scripts/proof_time.py            # prints a markdown table (docs/proof_time.md)

The candidate is ``reference.hstu_mha`` with targets, a contextual prefix of 2 and a window of N/4
(1024 at N=4096), exported with static shapes under ``FakeTensorMode`` (nothing allocated) and
rewritten; the time is the attention rewriter's proof (``RewriteReport.proofs``), best of ``--repeat``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hstu_inductor import _compat  # noqa: E402
from hstu_inductor.patterns import run_rewriters  # noqa: E402
from hstu_inductor.reference import hstu_mha  # noqa: E402
from hstu_inductor.report import collecting  # noqa: E402


class Attention(torch.nn.Module):
    def __init__(self, N):
        super().__init__()
        self.N = N

    def forward(self, q, k, v, offsets, num_targets):
        return hstu_mha(self.N, 0.125, q, k, v, offsets, num_targets=num_targets, max_attn_len=self.N // 4,
                        contextual_seq_len=2)


def proof_seconds(B, N, H, D) -> tuple:
    L = B * N - 3 * N // 2
    with FakeTensorMode():
        args = (torch.empty(L, H, D), torch.empty(L, H, D), torch.empty(L, H, D),
                torch.empty(B + 1, dtype=torch.int64), torch.empty(B, dtype=torch.int64))
        ep = torch.export.export(Attention(N), args)
    vals = [n.meta["val"] for n in ep.graph_module.graph.find_nodes(op="placeholder")]
    with collecting() as report, torch._guards.detect_fake_mode(vals):
        run_rewriters(_compat.trace_aten(ep.graph_module, vals))
    if report.counts["attention"] != 1:
        raise SystemExit(f"not rewritten at B={B} N={N} H={H} D={D}: {report.near_misses}")
    return report.proofs[0][2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    base = dict(B=128, N=4096, H=4, D=128)
    rows = [dict(base)]
    rows += [dict(base, B=b) for b in (8, 32)]
    rows += [dict(base, H=h) for h in (1, 8)]
    rows += [dict(base, D=d) for d in (64, 256)]
    rows += [dict(base, N=n) for n in (256, 1024, 16384)]
    print("| B | N | H | D | window | proof s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        secs = min(proof_seconds(**r) for _ in range(args.repeat))
        print(f"| {r['B']} | {r['N']} | {r['H']} | {r['D']} | {r['N'] // 4} | {secs:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""TorchEasyRec's original HSTU (``tzrec/modules/hstu.py``) under ``backend="hstu_eager"`` or ``"hstu"``.

Two ``SequentialTransductionUnitJagged`` layers with the paper's relative bias
(``RelativeBucketedTimeAndPositionBasedBias``: position table plus ``floor(log|dt| / 0.301)`` time
buckets) inside an encoder written as the original code writes it: the causal mask is a registered
buffer ``triu(ones(N, N), 1)`` and each layer gets ``1.0 - mask``. Training and inference; the
outputs and the gradients of the inputs and of every parameter are compared with eager.

    git clone https://github.com/alibaba/TorchEasyRec /tmp/TorchEasyRec   (read only: one file is loaded)
    .venv/bin/python scripts/peer_tzrec_hstu.py /tmp/TorchEasyRec [--backend hstu_eager] [--tables auto|on|off]

``--tables`` sets ``hstu_inductor.config.rab_tables``: the bias computed inside the kernels from the two
tables, or the dense bias the model builds (``auto``, the default: the tables in training). The file is loaded by path: ``tzrec`` itself
needs more packages than this check, ``hstu.py`` only torch and fbgemm.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

import hstu_inductor
import hstu_inductor.backend as hb
from hstu_inductor.report import collecting
from hstu_inductor.testing import fbgemm_shim

# torch.ops.fbgemm, which the file calls: fbgemm_gpu, else two of its ops in plain PyTorch
FBGEMM_SHIM = fbgemm_shim.install()


def load(root):
    spec = importlib.util.spec_from_file_location("tzrec_hstu", f"{root}/tzrec/modules/hstu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tzrec_hstu"] = mod  # Dynamo looks the module up by name for its globals
    spec.loader.exec_module(mod)
    return mod


class Encoder(torch.nn.Module):
    """The original HSTU's encoder around the file's layers: mask buffer, ``1 - mask``, two layers."""

    def __init__(self, hstu, N, E, H, D, num_buckets=128):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            hstu.SequentialTransductionUnitJagged(
                embedding_dim=E, linear_hidden_dim=D, attention_dim=D, dropout_ratio=0.0, attn_dropout_ratio=0.0,
                num_heads=H, linear_activation="silu",
                relative_attention_bias_module=hstu.RelativeBucketedTimeAndPositionBasedBias(
                    max_seq_len=N, num_buckets=num_buckets,
                    bucketization_fn=lambda x: (torch.log(torch.abs(x).clamp(min=1)) / 0.301).long()))
            for _ in range(2))
        self.register_buffer("_attn_mask", torch.triu(torch.ones((N, N), dtype=torch.bool), diagonal=1))

    def forward(self, x, offsets, timestamps):
        invalid_attn_mask = 1.0 - self._attn_mask.to(x.dtype)
        for layer in self.layers:
            x, _ = layer(x=x, x_offsets=offsets, all_timestamps=timestamps, invalid_attn_mask=invalid_attn_mask)
        return x


def inputs(N, E, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int64)
    L = int(offsets[-1])
    x = torch.randn(L, E, generator=g)
    # timestamps dense [B, N] as the original takes them, increasing in each sequence, gaps 0 .. ~1e6 s
    gaps = (torch.rand(len(lengths), N, generator=g) * 14).exp().floor().long()
    ts = gaps.cumsum(1)
    return x, offsets, ts


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(hstu, backend, train, N=16, E=32, H=2, D=16):
    torch.manual_seed(0)
    model = Encoder(hstu, N, E, H, D)
    model.train(train)
    x, offsets, ts = inputs(N, E, [N, 5, 0, 11], seed=1)
    x.requires_grad_(train)
    torch._dynamo.reset()
    hb.register()
    ctx = torch.enable_grad() if train else torch.no_grad()
    with ctx, collecting() as report:
        got = torch.compile(model, backend=backend)(x, offsets, ts)
    with ctx:
        want = model(x, offsets, ts)
    errs = [rel(got.detach(), want.detach())]
    if train:
        leaves = [x, *model.parameters()]
        g = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad(got, leaves, g, allow_unused=True),
                        torch.autograd.grad(want, leaves, g, allow_unused=True)):
            if b is not None:
                errs.append(rel(a, b) if a is not None else float("inf"))
    rab = sum("rab=" in d or "tables:" in d for k, d in report.details if k == "attention")
    return report, rab, max(errs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default="/tmp/TorchEasyRec")
    ap.add_argument("--backend", default="hstu_eager", choices=["hstu_eager", "hstu"])
    ap.add_argument("--tables", choices=["auto", "on", "off"], default="auto",
                    help="config.rab_tables: auto (the default: tables in training), on (path b), off (dense)")
    args = ap.parse_args()
    hstu = load(args.root)
    if FBGEMM_SHIM:
        print("fbgemm_gpu not installed: its jagged_to_padded_dense / dense_to_jagged in plain PyTorch (fbgemm_shim)")
    ok = True
    with hstu_inductor.config.patch(rab_tables={"auto": "auto", "on": True, "off": False}[args.tables]):
        for train in (False, True):
            report, rab, err = run(hstu, args.backend, train)
            c = report.counts
            line = (f"{'training ' if train else 'inference'}: attention {c['attention']}/2 (with its bias: {rab}), "
                    f"preprocess {c['preprocess']}/2, output {c['output']}/2; max rel err vs eager {err:.1e}")
            print(line)
            for kind, d in report.details:
                print(f"    + {kind}: {d}")
            for kind, r in report.near_misses:
                print(f"    - {kind}: {r}")
            ok = ok and c["attention"] == 2 and rab == 2 and err < 1e-4
    print("all layers rewritten with their bias and equal to eager" if ok else "NOT all rewritten / equal")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

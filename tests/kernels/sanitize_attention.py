"""Small TMA-variant forward + backward for ``compute-sanitizer`` (not a pytest module).

    HSTU_INDUCTOR_AUTOTUNE=0 compute-sanitizer --tool memcheck python3 tests/kernels/sanitize_attention.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from hstu_inductor.kernels import attention as K  # noqa: E402


def main():
    torch.manual_seed(0)
    lengths = [200, 1, 0, 256, 77]
    off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(lengths).cumsum(0)
    off = off.cuda()
    L, H, D = sum(lengths), 2, 64
    fused = torch.randn(L, 4 * H * D, device="cuda", dtype=torch.bfloat16)
    q, k, v = (fused[:, i * H * D:(i + 1) * H * D].view(L, H, D) for i in (1, 2, 3))
    nt = torch.tensor([3, 0, 0, 10, 5], device="cuda")
    kw = dict(num_targets=nt, max_attn_len=40, contextual_seq_len=3, min_full_attn_seq_len=20)
    for tma in (True, False):
        out = K.hstu_attention_fwd(q, k, v, off, 256, 0.1, tma=tma, **kw)
        dout = torch.randn_like(out)
        for det in (False, True):
            dq, dk, dv = K.hstu_attention_bwd(dout, q, k, v, off, 256, 0.1, tma=tma, deterministic=det, **kw)
        torch.cuda.synchronize()
        print(f"tma={tma}: out {out.float().norm():.4f} dq {dq.float().norm():.4f} dk {dk.float().norm():.4f} "
              f"dv {dv.float().norm():.4f}", flush=True)
    print("sanitize run done")


if __name__ == "__main__":
    main()

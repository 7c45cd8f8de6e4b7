"""Small attention forward + backward runs for ``compute-sanitizer`` (not a pytest module).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 HSTU_INDUCTOR_AUTOTUNE=0 compute-sanitizer --tool memcheck \
        python3 tests/kernels/sanitize_attention.py [--garbage]

Default: valid inputs with every mask feature, TMA and pointer variants, atomic and deterministic
backward, cached attention (the full forward's rows and kernels/delta.py, folded and two-launch).
``--garbage``: the same kernels on invalid jagged metadata (decreasing / negative / past-L offsets,
lengths past max_seq_len, targets outside [0, n], max_seq_len 1 and larger than any length): the
results are unspecified, but memcheck must report no error. Without the caching allocator
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1``) every tensor is its own allocation, so an access past a
tensor is an access past an allocation and memcheck sees it.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from hstu_inductor.kernels import attention as K  # noqa: E402
from hstu_inductor.kernels import delta as Kd  # noqa: E402


def _qkv(L, H, D):
    fused = torch.randn(L, 4 * H * D, device="cuda", dtype=torch.bfloat16)
    return (fused[:, i * H * D:(i + 1) * H * D].view(L, H, D) for i in (1, 2, 3))


def _run(q, k, v, off, N, tag, **kw):
    for tma in (True, False):
        out = K.hstu_attention_fwd(q, k, v, off, N, 0.1, tma=tma, **kw)
        dout = torch.randn_like(out)
        for det in (False, True):
            dq, dk, dv = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.1, tma=tma, deterministic=det, **kw)
        torch.cuda.synchronize()
        print(f"{tag} tma={tma}: out {out.float().norm():.4f} dq {dq.float().norm():.4f} "
              f"dk {dk.float().norm():.4f} dv {dv.float().norm():.4f}", flush=True)


def _delta(dq_rows, k, v, off, N, **kw):
    """Cached attention: the full forward's row blocks (pointer and TMA) and kernels/delta.py's key-range split
    (automatic, split 3 folded in one launch and summed by a second)."""
    for tma in (True, False):
        K.delta_hstu_attention_fwd(dq_rows, k, v, off, N, 0.1, tma=tma, **kw)
    for split, fold in ((None, True), (3, True), (3, False)):
        Kd.delta_forward(dq_rows, k, v, off, N, 0.1, split=split, fold=fold, **kw)
    torch.cuda.synchronize()


def valid():
    lengths = [200, 1, 0, 256, 77]
    off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(lengths).cumsum(0)
    q, k, v = _qkv(sum(lengths), 2, 64)
    nt = torch.tensor([3, 0, 0, 10, 5], device="cuda")
    _run(q, k, v, off.cuda(), 256, "valid", num_targets=nt, max_attn_len=40, contextual_seq_len=3,
         min_full_attn_seq_len=20)
    lengths[1:3] = [1, 1]  # cached attention needs D <= every length
    off[1:] = torch.tensor(lengths).cumsum(0)
    q, k, v = _qkv(sum(lengths), 2, 64)
    _delta(q[:len(lengths)].contiguous(), k, v, off.cuda(), 256, num_targets=nt, max_attn_len=40,
           contextual_seq_len=3)


def garbage():
    L = 300
    q, k, v = _qkv(L, 2, 64)
    cases = {  # name: (offsets, num_targets, max_seq_len)
        "decreasing": ([0, 250, 40, L], None, 256),
        "negative_start": ([-100, 10, L], None, 256),
        "past_L": ([0, 120, L + 1000], None, 256),
        "huge_offsets": ([2**40, -2**40, L], None, 256),
        "first_not_0_last_short": ([50, 100, L - 60], None, 256),
        "longer_than_max_seq_len": ([0, L], None, 128),
        "max_seq_len_1": ([0, 200, L], None, 1),
        "max_seq_len_past_lengths": ([0, 200, L], None, 4096),
        "targets_out_of_range": ([0, 200, L], [-7, 500], 256),
    }
    for name, (offsets, targets, N) in cases.items():
        off = torch.tensor(offsets, device="cuda")
        kw = dict(max_attn_len=40, contextual_seq_len=3, min_full_attn_seq_len=20)
        if targets is not None:
            kw["num_targets"] = torch.tensor(targets, device="cuda")
        _run(q, k, v, off, N, name, **kw)
        if off.abs().max() < 2**31:  # the kernels read int32 offsets too
            _run(q, k, v, off.to(torch.int32), N, name + "/int32", **kw)
        B = off.numel() - 1
        dq_rows = torch.randn(B * 3, 2, 64, device="cuda", dtype=torch.bfloat16)
        _delta(dq_rows, k, v, off, N, num_targets=kw.get("num_targets"))


def main():
    torch.manual_seed(0)
    if "--garbage" in sys.argv:
        garbage()
    else:
        valid()
    print("sanitize run done")


if __name__ == "__main__":
    main()

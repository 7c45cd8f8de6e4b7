"""Check the change list of docs/extending.md, "Add a mask option", by doing it.

    .venv/bin/python scripts/check_extending.py          # about a minute on CPU

Copies the package to a temporary directory, applies ``docs/extending_sink_rows.patch`` (an option
``sink_rows``: the first ``s`` keys of a sequence are visible to every query; it touches exactly the four files
the change list names) and, in a fresh interpreter on that copy, checks that:

* the reference mask equals a per-element loop of the rule;
* the Triton kernels (interpreter, forward and backward) equal the fp64 reference, and differ without the option;
* ``hstu::attention`` takes ``sink_rows`` as a keyword-only argument, its backward included;
* a plain-PyTorch model that spells the mask is found, proven and rewritten with ``sink_rows=3``, equal to eager.
"""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH = os.path.join(ROOT, "docs", "extending_sink_rows.patch")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(os.path.join(ROOT, "hstu_inductor"), os.path.join(tmp, "hstu_inductor"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run(["git", "apply", PATCH], cwd=tmp, check=True)
        files = subprocess.run(["git", "apply", "--numstat", PATCH], cwd=tmp, check=True, capture_output=True,
                               text=True).stdout.split("\n")
        touched = [line.split("\t")[-1] for line in files if line.strip()]
        print(f"patch touches {len(touched)} files: {', '.join(touched)}")
        env = dict(os.environ, PYTHONPATH=tmp, TRITON_INTERPRET="1")
        check = os.path.join(tmp, "_check.py")
        with open(check, "w") as f:
            f.write(CHECK)
        subprocess.run([sys.executable, check], env=env, check=True, cwd=tmp)
    print("the change list holds")


CHECK = r'''
import torch
import hstu_inductor  # noqa: F401
from hstu_inductor.kernels import attention as K
from hstu_inductor.reference import hstu_mha, hstu_mha_backward, hstu_mask
from hstu_inductor.spec import AttentionSpec

def loop_mask(lengths, N, spec, nt=None):
    """valid(i, j) by the definition, one element at a time (HSTU_SEMANTICS ids + the sink rule)."""
    B = len(lengths)
    out = torch.zeros(B, N, N, dtype=torch.bool)
    for b, n in enumerate(lengths):
        t = 0 if nt is None else int(nt[b])
        c, w, f, s = spec.contextual_seq_len, spec.max_attn_len, spec.min_full_attn_seq_len, spec.sink_rows
        def pi(p):
            x = max(p - c + 1, 0) if c > 0 else p
            end = (n - c + 1 if c > 0 else n) - t
            return min(x, end) if nt is not None else x, end
        for i in range(n):
            for j in range(n):
                pii, end = pi(i); pij, _ = pi(j)
                d = pii - pij
                v = i == j or d > 0
                if w > 0:
                    v = v and (d <= w or (f > 0 and pii >= end - f))
                if c > 0:
                    v = v or (pii == 0 and pij < end)
                v = v or j < s
                out[b, i, j] = v
    return out

lengths = [13, 0, 7, 16, 1]
N = 16
nt = torch.tensor([2, 0, 1, 3, 0])
for spec in [AttentionSpec(sink_rows=3), AttentionSpec(True, 4, 0, 0, sink_rows=2), AttentionSpec(True, 3, 2, 5, sink_rows=4)]:
    ref = hstu_mask(torch.tensor(lengths), N, nt, spec=spec)
    assert torch.equal(ref, loop_mask(lengths, N, spec, nt)), spec
print("reference mask == element loop")
assert not AttentionSpec(sink_rows=2).plain_causal  # the warp-specialised kernels step aside
assert AttentionSpec(sink_rows=2).kernel_lengths()[3] == 2

g = torch.Generator().manual_seed(0)
off = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
L, H, D = int(off[-1]), 2, 16
q, k, v = (torch.randn(L, H, D, generator=g) for _ in range(3))
dout = torch.randn(L, H, D, generator=g)
for spec in [AttentionSpec(sink_rows=3), AttentionSpec(True, 4, 0, 0, sink_rows=2), AttentionSpec(True, 3, 2, 5, sink_rows=4)]:
    ref = hstu_mha(N, 0.3, q.double(), k.double(), v.double(), off, num_targets=nt, training=False, spec=spec)
    with K.force_configs(fwd=(16, 16, 4, 1), dkdv=(16, 16, 4, 1), dq=(16, 16, 4, 1)):
        out = K.hstu_attention_fwd(q, k, v, off, N, 0.3, nt, spec=spec, tma=False)
        got = K.hstu_attention_bwd(dout, q, k, v, off, N, 0.3, nt, spec=spec, tma=False)
    refg = hstu_mha_backward(dout.double(), N, 0.3, q.double(), k.double(), v.double(), off, num_targets=nt, spec=spec)
    err = (out.double() - ref).norm() / ref.norm()
    gerr = max(((a.double() - b).norm() / b.norm()).item() for a, b in zip(got[:3], refg[:3]))
    assert err < 1e-5 and gerr < 1e-5, (spec, err, gerr)
    # the option matters: without it the result differs
    plain = hstu_mha(N, 0.3, q.double(), k.double(), v.double(), off, num_targets=nt, training=False,
                     spec=AttentionSpec(spec.causal, spec.max_attn_len, spec.contextual_seq_len, spec.min_full_attn_seq_len))
    assert (plain - ref).norm() / ref.norm() > 1e-3
print("kernels (interpreter, fwd + bwd) == reference")

# the op takes it as a keyword-only argument; autograd forwards it
qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
o = torch.ops.hstu.attention(qq, kk, vv, off, N, 0.3, nt, sink_rows=3)
o.backward(dout)
ref = hstu_mha(N, 0.3, q, k, v, off, num_targets=nt, training=False, spec=AttentionSpec(sink_rows=3))
assert torch.allclose(o, ref, atol=1e-6)
print("op schema:", torch.ops.hstu.attention.default._schema)

# a plain model spelling the sink is found and proven
def model(q, k, v, lengths, N=N):
    B = lengths.shape[0]
    offs = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    L = q.shape[0]
    seg = torch.bucketize(torch.arange(L), offs[1:], right=True)
    pos = torch.arange(L) - offs[seg]
    pad = lambda t: t.new_zeros(B, N, *t.shape[1:]).index_put((seg, pos), t)
    qp, kp, vp = pad(q), pad(k), pad(v)
    s = torch.einsum("bihd,bjhd->bhij", qp, kp)
    i = torch.arange(N)[:, None]; j = torch.arange(N)[None, :]
    keep = (j <= i) | (j < 3)
    inseq = (torch.arange(N)[None, :] < lengths[:, None])
    keep = keep[None, None] & inseq[:, None, :, None] & inseq[:, None, None, :]
    p = torch.nn.functional.silu(0.3 * s) * keep / N
    o = torch.einsum("bhij,bjhd->bihd", p, vp)
    return o[seg, pos]

lens = torch.tensor(lengths)
import hstu_inductor as hi
rep = hi.explain(model, q, k, v, lens, backend="hstu_eager")
print(rep)
assert rep.counts["attention"] == 1
assert torch.allclose(rep.output, model(q, k, v, lens), atol=1e-5)
print("model rewritten and equal to eager")
'''


if __name__ == "__main__":
    main()

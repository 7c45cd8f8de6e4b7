"""TorchEasyRec's own SLA attention under ``backend="hstu_eager"``: every config of
``pytorch_hstu_mha(attn_func=build_sla_func_tensor(...))`` (targets on/off x contextual 0/3 x
(k1, k2) = (3, 2) / (6, 0)), forward and q/k/v gradients against eager.

    git clone https://github.com/alibaba/TorchEasyRec /tmp/TorchEasyRec   (read only: two files are loaded)
    .venv/bin/python scripts/peer_tzrec_sla.py /tmp/TorchEasyRec

The two files are loaded by path (``tzrec`` itself needs more packages than this check):
``tzrec/ops/_pytorch/pt_hstu_attention.py`` whole, and ``build_sla_func_tensor`` from
``tzrec/ops/hstu_attention_utils.py``."""
import importlib.util, re, sys, itertools, torch
try:
    import fbgemm_gpu  # noqa: F401  (torch.ops.fbgemm, which TorchEasyRec calls)
except ImportError:
    pass
from typing import Optional
ROOT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/TorchEasyRec"
spec = importlib.util.spec_from_file_location("pt_hstu_attention", f"{ROOT}/tzrec/ops/_pytorch/pt_hstu_attention.py")
pt = importlib.util.module_from_spec(spec); sys.modules["pt_hstu_attention"] = pt; spec.loader.exec_module(pt)
src = open(f"{ROOT}/tzrec/ops/hstu_attention_utils.py").read()
fn_src = src[src.index("def build_sla_func_tensor("):src.index("\n@dataclass") if "\n@dataclass" in src[src.index("def build_sla_func_tensor("):] else src.index("def compute_stu_truncation_plan")]
ns = {"torch": torch, "Optional": Optional}; exec(fn_src, ns); build = ns["build_sla_func_tensor"]
import hstu_inductor, hstu_inductor.backend as hb
from hstu_inductor.report import collecting
ok = 0; n = 0
for targets, ctx, (k1, k2) in itertools.product([False, True], [0, 3], [(3, 2), (6, 0)]):
    torch.manual_seed(0)
    lengths = [12, 0, 7, 16]; N, H, D = 16, 2, 8
    off = torch.tensor([0] + lengths).cumsum(0); L = int(off[-1])
    nt = torch.tensor([2, 0, 1, 3]) if targets else None
    func = build(H, k1, k2, off, L, num_targets=nt, contextual_seq_len=ctx)
    q, k, v = (torch.randn(L, H, D, requires_grad=True) for _ in range(3))
    def f(q, k, v, off, nt, func):
        return pt.pytorch_hstu_mha(N, 0.25, q, k, v, off, causal=True, dropout_pr=0.0, training=True,
                                   num_targets=nt, contextual_seq_len=ctx, attn_func=func)
    eager = f(q, k, v, off, nt, func)
    ge = torch.autograd.grad(eager.sum(), (q, k, v))
    torch._dynamo.reset(); hb.register()
    with collecting() as rep:
        got = torch.compile(f, backend="hstu_eager")(q, k, v, off, nt, func)
    gg = torch.autograd.grad(got.sum(), (q, k, v))
    err = max([float((got - eager).detach().norm() / eager.detach().norm())] + [float((a - b).norm() / b.norm()) for a, b in zip(gg, ge)])
    r = rep.counts.get("attention", 0); n += 1; ok += (r == 1 and err < 1e-5)
    print(f"targets={targets} contextual={ctx} k1={k1} k2={k2}: attention rewritten {r}, max rel err (out, dq, dk, dv) {err:.1e}", rep.near_misses[:1])
print(f"{ok}/{n} configs rewritten and equal to eager")

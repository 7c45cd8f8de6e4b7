"""Helpers for the attention pattern tests (inputs, graph capture, summaries); no tests here."""
from __future__ import annotations

import torch

from hstu_inductor.patterns import rewrite_dynamo_graph
from hstu_inductor.testing import spellings_attention as sp
from hstu_inductor.report import collecting

H, D = 2, 4


def make_inputs(lengths, need_targets=False, scale=None, requires_grad=False, seed=0, extra=None, inputs="qkv"):
    """Random inputs for a spelling: ``(q, k, v, offsets, num_targets, attn_scale)``; with
    ``inputs="lengths"`` the 4th is per-sequence ``lengths``; with ``"uvqk"`` the inputs are
    ``(uvqk [L, 4*H*D], offsets, num_targets, attn_scale)``."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths, dtype=torch.int64)
    offsets = torch.tensor([0, *lens.cumsum(0).tolist()], dtype=torch.int64)
    L = int(offsets[-1])
    if inputs == "uvqk":
        tensors = (torch.randn(L, 4 * H * D, generator=g).requires_grad_(requires_grad),)
    else:
        tensors = tuple(torch.randn(L, H, D, generator=g).requires_grad_(requires_grad) for _ in range(3))
    nt = None
    if need_targets:
        nt = torch.tensor([torch.randint(0, n + 1, (), generator=g).item() for n in lengths], dtype=torch.int64)
    s = None
    if scale == "scalar":
        s = torch.rand((), generator=g) + 0.5
    elif scale == "row":
        s = torch.rand(L, generator=g) + 0.5
    args = (*tensors, lens if inputs == "lengths" else offsets, nt, s)
    return args + tuple(extra or ())


def spelling_inputs(name, lengths=(5, 0, 8, 1, 3), **kw):
    """Inputs for spelling ``name``; the default lengths hold 0, 1 and N = 8."""
    fn, need_nt, scale, _, _, inputs = sp.SPELLINGS[name]
    return fn, make_inputs(list(lengths), need_nt, scale, inputs=inputs, **kw)


def grad_leaves(args):
    """The tensors of ``args`` that require grad (q, k, v or uvqk, and attn_scale when set so)."""
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def _fmt(a):
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in a) + "]"
    if isinstance(a, float):
        return f"{a:g}"
    return str(a)


def summarize(gm: torch.fx.GraphModule) -> str:
    """One line per call_function: ``op(args)``; stable across runs of one torch version."""
    lines = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        name = str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))
        args = ", ".join(_fmt(a) for a in n.args)
        lines.append(f"{n.name} = {name}({args})")
    return "\n".join(lines)


def rewritten_graph(fn, *args, fullgraph=True):
    """Run Dynamo on ``fn`` and return (the rewritten ATen graph of its single frame, or of its
    first graph with ``fullgraph=False``, report)."""
    graphs = []

    def backend(gm, example_inputs):
        out = rewrite_dynamo_graph(gm)
        graphs.append(out)
        return gm.forward

    torch._dynamo.reset()
    with collecting() as report, torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=fullgraph)(*args)
    assert (len(graphs) == 1 or not fullgraph) and graphs[0] is not None, report
    return graphs[0], report

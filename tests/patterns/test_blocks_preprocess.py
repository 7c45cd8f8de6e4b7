"""preprocess: LayerNorm -> projection -> split into u, v, q, k -> silu(u)  =>  hstu.stu_preprocess."""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from expecttest import TestCase
from torch import nn

import hstu_inductor  # noqa: F401  (registers the backend and ops)
from hstu_inductor import reference
from _helpers import REWRITE_BACKEND
from test_blocks_common import assert_near_miss, check_compiled, rewritten, summary

E, HV, HQ, L = 16, 8, 6, 7


def _x(rows=L, seed=0, dtype=torch.float32):
    return torch.randn(rows, E, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rand(*shape):
    return nn.Parameter(torch.randn(*shape) * 0.5)


class RefPreprocess(nn.Module):
    """The reference spelling: F.layer_norm(x.float()).to(dtype) -> addmm -> split -> silu(u)."""

    def __init__(self, H=2, Dq=3, Dv=4, silu_all=False):
        super().__init__()
        self.H, self.Dq, self.Dv, self.silu_all = H, Dq, Dv, silu_all
        self.ln_w, self.ln_b = _rand(E), _rand(E)
        self.w, self.b = _rand(E, 2 * H * (Dq + Dv)), _rand(2 * H * (Dq + Dv))

    def forward(self, x):
        u, v, q, k = reference.stu_preprocess(x, self.ln_w, self.ln_b, self.w, self.b, self.H, self.Dq, self.Dv,
                                              silu_all=self.silu_all)
        return u * 2, v, q + 1, k


class ModulesChunk(nn.Module):
    """nn.LayerNorm + nn.Linear (bias) + chunk(4) + F.silu(u)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(E, eps=1e-5)
        self.proj = nn.Linear(E, 4 * HV)
        with torch.no_grad():
            self.norm.weight.normal_()
            self.norm.bias.normal_()

    def forward(self, x):
        u, v, q, k = self.proj(self.norm(x)).chunk(4, dim=-1)
        return F.silu(u), v, q, k


class SlicesSigmoid(nn.Module):
    """F.layer_norm without affine + F.linear without bias + slices + u * sigmoid(u)."""

    def __init__(self):
        super().__init__()
        self.w = _rand(2 * (HV + HQ), E)

    def forward(self, x):
        uvqk = F.linear(F.layer_norm(x, (E,), eps=1e-3), self.w)
        u = uvqk[:, :HV]
        v = uvqk[:, HV:2 * HV]
        q = uvqk[:, 2 * HV:2 * HV + HQ]
        k = uvqk[:, 2 * HV + HQ:]
        return u * torch.sigmoid(u), v, q, k


class MatmulSiluAll(nn.Module):
    """LayerNorm -> n @ W + b -> silu(uvqk) -> split: silu on all four."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(E)
        self.w, self.b = _rand(E, 2 * (HV + HQ)), _rand(2 * (HV + HQ))

    def forward(self, x):
        uvqk = F.silu(self.ln(x) @ self.w + self.b)
        u, v, q, k = torch.split(uvqk, [HV, HV, HQ, HQ], dim=1)
        return u, v.reshape(-1, 2, HV // 2), q, k


class SiluEachChunkAfterView(nn.Module):
    """silu applied to every chunk separately, u's silu after a view: silu_all via pieces."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(E, elementwise_affine=False)
        self.proj = nn.Linear(E, 2 * (HV + HQ), bias=False)

    def forward(self, x):
        u, v, q, k = torch.split(self.proj(self.ln(x)), [HV, HV, HQ, HQ], dim=-1)
        u = F.silu(u.view(-1, 2, HV // 2))
        return u, F.silu(v), F.silu(q), F.silu(k)


class SiluEachChunkStrides(nn.Module):
    """silu on every chunk: the rewrite gives column views of the op's packed output where the user's
    code had contiguous silu results. Pointwise users take the views as they are (u, k); a view that
    needs contiguity (q's ``view(-1)``) or a graph output (v: the caller sees its strides) gets a
    contiguous copy of that piece."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(E)
        self.proj = nn.Linear(E, 2 * (HV + HQ))

    def forward(self, x):
        u, v, q, k = torch.split(self.proj(self.ln(x)), [HV, HV, HQ, HQ], dim=-1)
        return F.silu(u) + 1, F.silu(v).view(-1, 2, HV // 2), F.silu(q).view(-1) * 3, F.silu(k) * 2


class NormReused(nn.Module):
    """The LayerNorm output is also used elsewhere: it stays alive, the block is still fused."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(E)
        self.proj = nn.Linear(E, 2 * (HV + HQ))

    def forward(self, x):
        n = self.ln(x)
        u, v, q, k = torch.split(self.proj(n), [HV, HV, HQ, HQ], dim=-1)
        return F.silu(u), v, q, k, n.sum(-1)


class Bf16Upcast(RefPreprocess):
    """Reference spelling on bf16 input: x.float() -> layer norm -> .to(bf16)."""


class TestPreprocessSpellings(TestCase):
    def _graph(self, m, *args, spelling=None):
        graphs, report = rewritten(m, *args)
        self.assertEqual(report.counts["preprocess"], 1, str(report))
        if spelling is not None:
            self.assertEqual([d for k, d in report.details if k == "preprocess"], [spelling])
        return summary(graphs[0])

    def test_reference(self):
        m = RefPreprocess()
        self.assertExpectedInline(self._graph(m, _x(), spelling="layer_norm -> addmm -> split -> silu(u)"), """\
t_default = t(arg2_1)
stu_preprocess_save_default = hstu.stu_preprocess_save(arg4_1, arg0_1, arg1_1, 1e-06, t_default, arg3_1, 8, 6, False)
getitem_7 = getitem(stu_preprocess_save_default, 0)
getitem_8 = getitem(stu_preprocess_save_default, 1)
slice_tensor = slice.Tensor(getitem_8, 1, 8, 16)
slice_tensor_1 = slice.Tensor(getitem_8, 1, 16, 22)
slice_tensor_2 = slice.Tensor(getitem_8, 1, 22, 28)
view = view(slice_tensor, [7, 2, 4])
view_1 = view(slice_tensor_1, [7, 2, 3])
view_2 = view(slice_tensor_2, [7, 2, 3])
mul = mul.Tensor(getitem_7, 2)
add = add.Tensor(view_1, 1)""")
        check_compiled(m, _x(), train=True, counts={"preprocess": 1})
        check_compiled(m, _x(seed=1), train=False, counts={"preprocess": 1})

    def test_modules_chunk(self):
        m = ModulesChunk()
        self.assertExpectedInline(self._graph(m, _x(), spelling="layer_norm -> linear+bias -> chunk -> silu(u)"),
                                  """\
stu_preprocess_save_default = hstu.stu_preprocess_save(arg2_1, arg0_1, arg1_1, 1e-05, arg3_1, arg4_1, 8, 8, False)
getitem_7 = getitem(stu_preprocess_save_default, 0)
getitem_8 = getitem(stu_preprocess_save_default, 1)
slice_tensor = slice.Tensor(getitem_8, 1, 8, 16)
slice_tensor_1 = slice.Tensor(getitem_8, 1, 16, 24)
slice_tensor_2 = slice.Tensor(getitem_8, 1, 24, 32)""")
        check_compiled(m, _x(), train=True, counts={"preprocess": 1})
        check_compiled(m, _x(seed=1), train=False, counts={"preprocess": 1})

    def test_layer_norm_by_hand(self):
        """``b + w * ((x - mean) * rsqrt(var + eps))`` with a biased variance: the op's layer norm (the probe
        checks the values; the unbiased variance is a near miss below)."""
        m = Split(norm="by_hand")
        with torch.no_grad():
            m.ln.weight.normal_()
            m.ln.bias.normal_()
        self._graph(m, _x(), spelling="layer_norm(hand-written) -> linear+bias -> split -> silu(u)")
        check_compiled(m, _x(), train=True, counts={"preprocess": 1})

    def test_slices_sigmoid(self):
        m = SlicesSigmoid()
        self.assertExpectedInline(self._graph(m, _x(), spelling="layer_norm -> linear -> slices -> x*sigmoid(x)(u)"),
                                  """\
stu_preprocess_save_default = hstu.stu_preprocess_save(arg0_1, None, None, 0.001, arg1_1, None, 8, 6, False)
getitem_3 = getitem(stu_preprocess_save_default, 0)
getitem_4 = getitem(stu_preprocess_save_default, 1)
slice_tensor = slice.Tensor(getitem_4, 1, 8, 16)
slice_tensor_1 = slice.Tensor(getitem_4, 1, 16, 22)
slice_tensor_2 = slice.Tensor(getitem_4, 1, 22, 28)""")
        check_compiled(m, _x(), train=True, counts={"preprocess": 1})
        check_compiled(m, _x(seed=1), train=False, counts={"preprocess": 1})

    def test_matmul_silu_all(self):
        m = MatmulSiluAll()
        self.assertExpectedInline(self._graph(m, _x(), spelling="layer_norm -> matmul + bias -> split -> silu before split(all)"),
                                  """\
t_default = t(arg3_1)
stu_preprocess_save_default = hstu.stu_preprocess_save(arg2_1, arg0_1, arg1_1, 1e-05, t_default, arg4_1, 8, 6, True)
getitem_7 = getitem(stu_preprocess_save_default, 0)
slice_tensor = slice.Tensor(getitem_7, 1, 0, 8)
slice_tensor_1 = slice.Tensor(getitem_7, 1, 8, 16)
slice_tensor_2 = slice.Tensor(getitem_7, 1, 16, 22)
slice_tensor_3 = slice.Tensor(getitem_7, 1, 22, 28)
view = view(slice_tensor_1, [7, 2, 4])""")
        check_compiled(m, _x(), train=True, counts={"preprocess": 1})
        check_compiled(m, _x(seed=1), train=False, counts={"preprocess": 1})

    def test_silu_each_chunk_after_view(self):
        m = SiluEachChunkAfterView()
        self.assertExpectedInline(self._graph(m, _x(), spelling="layer_norm -> linear -> split -> silu(all)"), """\
stu_preprocess_save_default = hstu.stu_preprocess_save(arg0_1, None, None, 1e-05, arg1_1, None, 8, 6, True)
getitem_7 = getitem(stu_preprocess_save_default, 0)
slice_tensor = slice.Tensor(getitem_7, 1, 0, 8)
slice_tensor_1 = slice.Tensor(getitem_7, 1, 8, 16)
clone_default_1 = clone(slice_tensor_1, memory_format=torch.contiguous_format)
slice_tensor_2 = slice.Tensor(getitem_7, 1, 16, 22)
clone_default_2 = clone(slice_tensor_2, memory_format=torch.contiguous_format)
slice_tensor_3 = slice.Tensor(getitem_7, 1, 22, 28)
clone_default_3 = clone(slice_tensor_3, memory_format=torch.contiguous_format)
view_1 = view(slice_tensor, [-1, 2, 4])
clone_default = clone(view_1, memory_format=torch.contiguous_format)""")
        check_compiled(m, _x(), train=True, counts={"preprocess": 1})
        check_compiled(m, _x(seed=1), train=False, counts={"preprocess": 1})

    def test_silu_each_chunk_strides(self):
        m = SiluEachChunkStrides()
        self.assertExpectedInline(self._graph(m, _x(), spelling="layer_norm -> linear+bias -> split -> silu(all)"),
                                  """\
stu_preprocess_save_default = hstu.stu_preprocess_save(arg2_1, arg0_1, arg1_1, 1e-05, arg3_1, arg4_1, 8, 6, True)
getitem_7 = getitem(stu_preprocess_save_default, 0)
slice_tensor = slice.Tensor(getitem_7, 1, 0, 8)
slice_tensor_1 = slice.Tensor(getitem_7, 1, 8, 16)
clone_default = clone(slice_tensor_1, memory_format=torch.contiguous_format)
slice_tensor_2 = slice.Tensor(getitem_7, 1, 16, 22)
clone_default_1 = clone(slice_tensor_2, memory_format=torch.contiguous_format)
slice_tensor_3 = slice.Tensor(getitem_7, 1, 22, 28)
add = add.Tensor(slice_tensor, 1)
view = view(clone_default, [-1, 2, 4])
view_1 = view(clone_default_1, [-1])
mul = mul.Tensor(view_1, 3)
mul_1 = mul.Tensor(slice_tensor_3, 2)""")
        check_compiled(m, _x(), train=True, counts={"preprocess": 1})
        check_compiled(m, _x(seed=1), train=False, counts={"preprocess": 1})
        torch._dynamo.reset()
        got = torch.compile(m, backend=REWRITE_BACKEND)(_x(seed=2))
        self.assertEqual([t.stride() for t in got], [t.stride() for t in m(_x(seed=2))])

    def test_norm_reused(self):
        m = NormReused()
        g = self._graph(m, _x())
        self.assertIn("native_layer_norm", g)  # kept for the other user
        self.assertIn("hstu.stu_preprocess", g)
        check_compiled(m, _x(), train=True, counts={"preprocess": 1})

    def test_bf16_upcast(self):
        m = Bf16Upcast().to(torch.bfloat16)
        x = _x(dtype=torch.bfloat16)
        self.assertExpectedInline(self._graph(m, x, spelling="layer_norm(fp32) -> addmm -> split -> silu(u)"),
                                  """\
t_default = t(arg2_1)
stu_preprocess_save_default = hstu.stu_preprocess_save(arg4_1, arg0_1, arg1_1, 1e-06, t_default, arg3_1, 8, 6, False)
getitem_7 = getitem(stu_preprocess_save_default, 0)
getitem_8 = getitem(stu_preprocess_save_default, 1)
slice_tensor = slice.Tensor(getitem_8, 1, 8, 16)
slice_tensor_1 = slice.Tensor(getitem_8, 1, 16, 22)
slice_tensor_2 = slice.Tensor(getitem_8, 1, 22, 28)
view = view(slice_tensor, [7, 2, 4])
view_1 = view(slice_tensor_1, [7, 2, 3])
view_2 = view(slice_tensor_2, [7, 2, 3])
mul = mul.Tensor(getitem_7, 2)
add = add.Tensor(view_1, 1)""")
        check_compiled(m, x, train=True, rtol=2e-2, grad_rtol=5e-2, counts={"preprocess": 1})


class TestPreprocessBackwardModes(TestCase):
    """``config.block_backward``: "save" (default, the spelling tests above) emits
    ``stu_preprocess_save`` (the backward reads the forward's normalised x, statistics and
    pre-activations); "recompute" emits ``stu_preprocess``. Both equal eager."""

    def test_recompute_mode_graph_and_results(self):
        for m, silu_all in ((RefPreprocess(), False), (MatmulSiluAll(), True)):
            with hstu_inductor.config.patch(block_backward="recompute"):
                graphs, report = rewritten(m, _x())
                self.assertEqual(report.counts["preprocess"], 1, str(report))
                g = summary(graphs[0])
                self.assertIn("= hstu.stu_preprocess(arg", g)
                self.assertNotIn("stu_preprocess_save", g)
                self.assertIn(f", {silu_all})", g)
                check_compiled(m, _x(seed=2), train=True, counts={"preprocess": 1})
                check_compiled(m, _x(seed=3), train=False, counts={"preprocess": 1})

    def test_fp64_against_the_reference(self):
        """The rewritten block (u, v, q, k as views of the op's outputs) equals the eager reference in
        fp64 on fresh random inputs and parameters: outputs and the gradients of x, the LayerNorm
        weight and bias, W and b, for silu on u or on all four, in both backward modes."""
        for i, (mode, silu_all) in enumerate(itertools.product(("save", "recompute"), (False, True))):
            with self.subTest(mode=mode, silu_all=silu_all), hstu_inductor.config.patch(block_backward=mode):
                torch.manual_seed(100 + i)
                m = RefPreprocess(silu_all=silu_all).double()
                check_compiled(m, _x(seed=200 + i, dtype=torch.float64), train=True, rtol=1e-10, grad_rtol=1e-10,
                               counts={"preprocess": 1})

    def test_bad_mode_rejected(self):
        with self.assertRaisesRegex(ValueError, "block_backward"):
            with hstu_inductor.config.patch(block_backward="keep"):
                pass


# ---------------------------------------------------------------------------------------------
# near misses: left to stock Inductor, with a reason
# ---------------------------------------------------------------------------------------------
class Split(nn.Module):
    """Configurable LN -> linear -> split -> activation, for near-miss variants."""

    def _by_hand(self, x, unbiased):
        """A layer norm written out (``rsqrt`` of the variance plus eps; ``unbiased``: not a layer norm)."""
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=unbiased)
        return self.ln.bias + self.ln.weight * ((x - mean) * torch.rsqrt(var + 1e-5))

    def __init__(self, sizes=(HV, HV, HQ, HQ), silu_chunk=0, norm="ln", extra=None):
        super().__init__()
        self.sizes, self.silu_chunk, self.norm, self.extra = list(sizes), silu_chunk, norm, extra
        self.ln = nn.LayerNorm(E)
        self.rms = nn.RMSNorm(E)
        self.proj = nn.Linear(E, sum(sizes))

    def forward(self, x):
        n = {"ln": lambda: self.ln(x), "rms": lambda: self.rms(x),
             "ln2d": lambda: F.layer_norm(x, x.shape),
             "by_hand": lambda: self._by_hand(x, unbiased=False),
             "by_hand_unbiased": lambda: self._by_hand(x, unbiased=True)}[self.norm]()
        uvqk = self.proj(n)
        parts = list(torch.split(uvqk, self.sizes, dim=-1))
        raw_u = parts[0]
        if self.extra == "inplace":
            parts[0] = F.silu(parts[0], inplace=True)
        elif self.silu_chunk is not None:
            parts[self.silu_chunk] = F.silu(parts[self.silu_chunk])
        out = tuple(parts)
        if self.extra == "raw_u":
            out += (raw_u * 3,)
        if self.extra == "uvqk":
            out += (uvqk.sum(),)
        return out


class TestPreprocessNearMisses(TestCase):
    def test_split_sizes_not_aabb(self):
        assert_near_miss(Split(sizes=(HV, HQ, HV, HQ)), _x(), kind="preprocess",
                         contains="are not [hv, hv, hq, hq]")

    def test_silu_on_wrong_chunk(self):
        assert_near_miss(Split(silu_chunk=1), _x(), kind="preprocess", contains="silu is applied to chunk 1 (v)")

    def test_no_silu(self):
        assert_near_miss(Split(silu_chunk=None), _x(), kind="preprocess",
                         contains="u (chunk 0) is not consumed only by silu(u)")

    def test_layer_norm_by_hand_with_unbiased_variance(self):
        assert_near_miss(Split(norm="by_hand_unbiased"), _x(), kind="preprocess", contains="numeric probe")

    def test_rms_norm(self):
        assert_near_miss(Split(norm="rms"), _x(), kind="preprocess", contains="is not a LayerNorm of x")

    def test_layer_norm_over_two_dims(self):
        assert_near_miss(Split(norm="ln2d"), _x(), kind="preprocess", contains="not over the last dim")

    def test_raw_u_has_other_users(self):
        assert_near_miss(Split(extra="raw_u"), _x(), kind="preprocess",
                         contains="u (chunk 0) is not consumed only by silu(u)", train=True)

    def test_projection_output_has_other_users(self):
        assert_near_miss(Split(extra="uvqk"), _x(), kind="preprocess", contains="projection output has other users")

    def test_inplace_silu(self):
        assert_near_miss(Split(extra="inplace"), _x(), kind="preprocess", contains="not four consecutive blocks")


class UpcastWithoutDowncast(nn.Module):
    """bf16 x, LayerNorm in fp32 and the projection kept in fp32: not the op's dtype semantics."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(E)
        self.w = _rand(2 * (HV + HQ), E)

    def forward(self, x):
        n = self.ln(x.float())
        u, v, q, k = torch.split(F.linear(n, self.w), [HV, HV, HQ, HQ], dim=-1)
        return F.silu(u), v, q, k


class TestPreprocessDtypes(TestCase):
    def test_upcast_without_downcast(self):
        assert_near_miss(UpcastWithoutDowncast(), _x(dtype=torch.bfloat16), kind="preprocess",
                         contains="missing or different downcast")


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()

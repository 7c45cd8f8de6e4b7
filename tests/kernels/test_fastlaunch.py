"""The cached launch path of the Gluon kernels (hstu_inductor/kernels/fastlaunch.py), on CPU.

Two parts. (1) The key against Triton's own specialisation (``native_specialize_impl``, what
``JITFunction.run``'s binder calls): arguments with equal keys must get equal Triton specialisations, else a
cached launch could run a kernel compiled for another one. (2) ``gluon_forward`` / ``gluon_backward`` on CPU
tensors against a fake sm90 device: Triton's real ``JITFunction.run`` (binder, cache key, launcher call) with
compilation replaced by fake ``CompiledKernel`` objects that record their launches. So the first call goes
through Triton, later ones through the cache, and both must hand the launcher the same arguments.
The GPU check (real kernels, bitwise equal outputs) is tests/kernels/test_gluon_fastlaunch.py.
"""
from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from triton import knobs  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402
from triton.runtime.driver import driver as DRIVER  # noqa: E402
from triton.runtime.jit import native_specialize_impl  # noqa: E402

import hstu_inductor  # noqa: E402
from hstu_inductor.kernels import fastlaunch as fl  # noqa: E402
from hstu_inductor.kernels import gluon_attention as ga  # noqa: E402
from hstu_inductor.kernels import gluon_backward as gb  # noqa: E402

KERNELS = (ga._hstu_fwd_ws_persistent_kernel, ga._hstu_fwd_ws_kernel, gb._hstu_bwd_dkdv_ws_kernel,
           gb._hstu_bwd_dq_ws_kernel)


def _triton_spec(a):
    if type(a) is fl.Desc:
        a = a.gluon()
    return native_specialize_impl(BaseBackend, a, False, True, True)


def _assert_sound(args):
    """Equal keys => equal Triton specialisations (and say how much finer the key is, for the record)."""
    by_key = defaultdict(set)
    for a in args:
        by_key[fl._arg_key((a, ))].add(_triton_spec(a))
    bad = {k: v for k, v in by_key.items() if len(v) > 1}
    assert not bad, f"one key, several Triton specialisations: {bad}"


INTS = [0, 1, 2, 3, 15, 16, 17, 32, 48, 1000, 1024, 4096 * 128, -1, -15, -16, -17, 2**31 - 16, 2**31 - 1, 2**31,
        2**31 + 16, -2**31, -2**31 - 1, -2**31 - 16, 2**40, 2**40 + 1, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16,
        2**64 - 16, 2**64 - 1]


def test_int_key_matches_triton():
    _assert_sound(INTS)
    # and no finer than Triton's: one key per specialisation
    by_spec = defaultdict(set)
    for a in INTS:
        by_spec[_triton_spec(a)].add(fl._arg_key((a, )))
    assert all(len(v) == 1 for v in by_spec.values()), by_spec


def test_tensor_and_float_keys_match_triton():
    base = torch.zeros(64, dtype=torch.float64)  # CPU allocations are 64-byte aligned
    tensors = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64):
        t = base.view(dtype)
        tensors += [t[i:] for i in range(0, 9)]
    _assert_sound(tensors + [0.5, 1.0, -3.25, 1e30])


def test_desc_key_matches_triton():
    buf = torch.zeros(16 * 2048 + 64, dtype=torch.bfloat16)
    descs = []
    for dtype, rows, row_stride in itertools.product((torch.bfloat16, torch.float16), (64, 128), (512, 2048)):
        t = buf.view(dtype)[:16 * row_stride].view(16, row_stride)[:, :512].view(16, 4, 128)
        descs.append(ga._desc_2d(t, rows, ga._smem_layout(rows, 128, dtype)))
    _assert_sound(descs)
    assert len({d.key for d in descs}) == 4  # dtype x block rows
    # a base off 16-byte alignment (which the gluon descriptor rejects) has a key of its own
    t = buf[4:4 + 16 * 512].view(16, 4, 128)
    assert ga._desc_2d(t, 64, ga._smem_layout(64, 128, t.dtype)).key not in {d.key for d in descs}


def test_unmodelled_arguments_are_not_keyed():
    class Sub(torch.Tensor):
        pass

    for a in (True, torch.zeros(2).as_subclass(Sub), torch.tensor(3).numpy()[()]):
        assert fl._arg_key((0, a)) is None


def test_none_and_do_not_specialize_keys_match_triton():
    """None (a constexpr None to Triton) keys apart from every value; a ``do_not_specialize`` argument keys by
    what Triton types it by (an int's range, a pointer's dtype), no finer and no coarser."""
    assert fl._arg_key((None, )) == ("none", ) and _triton_spec(None) == ("constexpr", None)
    base = torch.zeros(64, dtype=torch.float64)
    args = INTS + [base.view(dtype)[i:] for dtype in (torch.int32, torch.int64) for i in range(0, 5)]
    by_key, by_spec = defaultdict(set), defaultdict(set)
    for a in args:
        spec = native_specialize_impl(BaseBackend, a, False, False, True)
        by_key[fl._arg_key((a, ), nospec={0})].add(spec)
        by_spec[spec].add(fl._arg_key((a, ), nospec={0}))
    assert all(len(v) == 1 for v in by_key.values()), by_key
    assert all(len(v) == 1 for v in by_spec.values()), by_spec


# ---------------------------------------------------------------------------------------------------------------
# a fake sm90 device: Triton's JITFunction.run for real, compilation and the C launcher faked
# ---------------------------------------------------------------------------------------------------------------


class _Driver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 77


class FakeGPU:
    def __init__(self):
        self.compiled = []  # (kernel, signature, constexprs, attrs) per compile
        self.launches = []  # (compiled, launcher args) per launch

    def do_compile(self, kernel):
        def _do_compile(key, signature, device, constexprs, options, attrs, warmup):
            ck = object.__new__(CompiledKernel)
            ck.module, ck.function, ck.src, ck.name = object(), 1000 + len(self.compiled), None, "fake"
            ck.packed_metadata = ("packed", ck.function)
            ck._run = lambda *a, _ck=ck: self.launches.append((_ck, a))
            self.compiled.append((kernel, signature, constexprs, attrs))
            kernel.device_caches[device][0][key] = ck
            return ck
        return _do_compile

    def normalised(self, i, names=None):
        """Launch i as the launcher sees it: descriptors by what the launcher reads of them, addresses by the
        name ``names`` gives them (a fresh output has another address in each call)."""
        ck, a = self.launches[i]
        names = {t.data_ptr(): n for n, t in (names or {}).items()}
        out = []
        for x in a[9:]:
            if hasattr(x, "block_shape"):
                x = ("desc", names.get(x.base.data_ptr(), "other"), list(x.shape), list(x.strides), x.padding)
            elif isinstance(x, torch.Tensor):
                x = ("ptr", names.get(x.data_ptr(), "other"), x.dtype)
            out.append(x)
        return ck, a[:6], out, a[6:9]


@pytest.fixture
def fake_gpu(monkeypatch):
    fake = FakeGPU()
    monkeypatch.setattr(DRIVER, "_active", _Driver())
    for kern in KERNELS:
        monkeypatch.setattr(kern, "device_caches", defaultdict(kern.create_binder))
        monkeypatch.setattr(kern, "_do_compile", fake.do_compile(kern))
    monkeypatch.setattr(ga, "_num_sms", lambda device: 8)
    monkeypatch.setattr(hstu_inductor.config, "fastlaunch", "verify")
    fl.clear()
    yield fake
    fl.clear()


def _case(B=3, N=200, H=2, dtype=torch.bfloat16, targets=True, fused=False, seed=0, odd=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, N + 1, (B, ), generator=g)
    off = torch.zeros(B + 1, dtype=torch.int64)
    off[1:] = lengths.cumsum(0)
    L = int(off[-1])
    if fused:  # views of one projection: row stride 4 * H * D
        x = torch.randn(L, 4 * H * 128, generator=g).to(dtype)
        q, k, v = (x[:, i * H * 128:(i + 1) * H * 128].view(L, H, 128) for i in (1, 2, 3))
    else:
        q, k, v = (torch.randn(L, H, 128, generator=g).to(dtype) for _ in range(3))
    nt = torch.minimum(torch.randint(0, 5, (B, ), generator=g), lengths) if targets else None
    if odd:  # offsets and targets 8 bytes off 16-byte alignment (Triton specialises pointers on it)
        off = torch.cat([off[:1], off])[1:]
        nt = None if nt is None else torch.cat([nt[:1], nt])[1:]
    return q, k, v, off, N, nt


def _fwd(c, **kw):
    q, k, v, off, N, nt = c
    return ga.gluon_forward(q, k, v, off, N, 0.1, nt, **kw)


def _bwd(c, **kw):
    q, k, v, off, N, nt = c
    return gb.gluon_backward(q.clone(), q, k, v, off, N, 0.1, nt, **kw)


@pytest.mark.parametrize("persistent", [True, False])
def test_second_call_is_cached_with_the_same_launch(fake_gpu, persistent):
    cfg = dict(PERSISTENT=persistent)
    c = _case()
    q, k, v, off, _, nt = c
    outs = [_fwd(c, config=cfg) for _ in range(2)]
    assert len(fake_gpu.compiled) == 1 and len(fake_gpu.launches) == 2
    ck0, head0, args0, hooks0 = fake_gpu.normalised(0, dict(q=q, k=k, v=v, off=off, nt=nt, out=outs[0]))
    ck1, head1, args1, hooks1 = fake_gpu.normalised(1, dict(q=q, k=k, v=v, off=off, nt=nt, out=outs[1]))
    assert ck0 is ck1
    assert head0[:5] == head1[:5]  # grid, stream, function, packed metadata
    assert args0 == args1  # every kernel argument, constexprs included, in the launcher's order
    assert hooks1 == (None, None, None)  # no launch metadata, no hook chains
    assert hooks0[1] is knobs.runtime.launch_enter_hook  # the first one was Triton's own launch


def test_backward_cached(fake_gpu):
    q, k, v, off, N, _ = c = _case(targets=False)
    g = q.clone()
    got = [gb.gluon_backward(g, q, k, v, off, N, 0.1) for _ in range(2)]
    assert len(fake_gpu.compiled) == 2 and len(fake_gpu.launches) == 4  # dK/dV and dQ kernels, twice
    names = [dict(q=q, k=k, v=v, g=g, off=off, dq=dq, dk=dk, dv=dv) for dq, dk, dv in got]
    for i in (0, 1):
        a, b = fake_gpu.normalised(i, names[0]), fake_gpu.normalised(i + 2, names[1])
        assert a[0] is b[0] and a[2] == b[2] and b[3] == (None, None, None)


def test_new_tensors_same_shape_reuse_the_entry(fake_gpu):
    _fwd(_case(seed=1))
    _fwd(_case(seed=2))  # same lengths? no: other lengths, same specialisation here
    assert len(fake_gpu.compiled) == 1 and len(fake_gpu.launches) == 2


def test_other_specialisations_compile_again(fake_gpu):
    """Cases whose Triton specialisation differs from the warm entry's: each must compile its own kernel (verify
    mode also checks each cached launch against Triton's cache)."""
    _fwd(_case())
    base = len(fake_gpu.compiled)
    _fwd(_case(targets=False))  # HAS_TGT
    _fwd(_case(dtype=torch.float16))  # descriptor dtype
    _fwd(_case(H=1))  # H == 1 is a constexpr in Triton
    _fwd(_case(B=1, N=1))  # L == 1, MAX_N == 1
    _fwd(_case(B=40, N=300))  # more items than CTAs: DYNAMIC
    _fwd(_case(odd=True))  # pointer alignment
    assert len(fake_gpu.compiled) == base + 6
    n = len(fake_gpu.compiled)
    for c in (_case(targets=False, seed=3), _case(dtype=torch.float16, seed=4), _case(H=1, seed=5)):
        _fwd(c)  # warm now: cached, and verified against Triton's binder
    assert len(fake_gpu.compiled) == n


def test_verify_sweep(fake_gpu):
    """Many shapes, layouts and alignments, forward and backward, twice each: every cached launch is checked
    against the kernel Triton's own binder and cache pick (verify mode raises otherwise)."""
    for B, N, H, tg, fused, odd in itertools.product((1, 2, 5), (1, 16, 130), (1, 2, 3), (True, False),
                                                    (True, False), (True, False)):
        c = _case(B, N, H, torch.bfloat16, tg, fused, seed=B * N + H, odd=odd)
        for _ in range(2):
            _fwd(c)
            _bwd(c)
    assert len(fake_gpu.launches) > 2 * len(fake_gpu.compiled)  # most launches were cached


def test_verify_catches_a_wrong_entry(fake_gpu):
    c = _case()
    _fwd(c)
    cache = fl._CACHES[id(ga._hstu_fwd_ws_persistent_kernel)][1]
    ((key, entry), ) = cache.items()
    cache[key] = (*entry[:4], object.__new__(CompiledKernel))
    with pytest.raises(AssertionError, match="differs from Triton"):
        _fwd(c)


def test_off_always_goes_through_triton(fake_gpu, monkeypatch):
    monkeypatch.setattr(hstu_inductor.config, "fastlaunch", "off")
    c = _case()
    for _ in range(3):
        _fwd(c)
    assert len(fake_gpu.launches) == 3 and not fl._CACHES
    assert all(fake_gpu.normalised(i)[3][1] is knobs.runtime.launch_enter_hook for i in range(3))


def test_launch_hooks_take_tritons_path(fake_gpu):
    c = _case()
    _fwd(c)
    seen = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        _fwd(c)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert fake_gpu.normalised(1)[3][1] is knobs.runtime.launch_enter_hook
    _fwd(c)
    assert fake_gpu.normalised(2)[3] == (None, None, None)


def test_misaligned_descriptor_is_never_cached(fake_gpu):
    """A base off 16-byte alignment has its own key, so it reaches the gluon descriptor's check (uncached)."""
    q, k, v, off, N, nt = _case()
    _fwd((q, k, v, off, N, nt))
    y = torch.zeros(q.numel() + 4, dtype=q.dtype)[4:].view(q.shape)  # 8 bytes off
    with pytest.raises(AssertionError, match="16-byte aligned"):
        ga.gluon_forward(y, k, v, off, N, 0.1, nt, checked=True)


_G = gl.constexpr(3)


@gluon.jit
def _toy_ok(X, n, C: gl.constexpr):
    gl.store(X + n, C)


@gluon.jit(do_not_specialize=["n"])
def _toy_dns(X, n, C: gl.constexpr):
    gl.store(X + n, C)


@gluon.jit(do_not_specialize_on_alignment=["n"])
def _toy_dnsa(X, n, C: gl.constexpr):
    gl.store(X + n, C)


@gluon.jit
def _toy_global(X, n, C: gl.constexpr):
    gl.store(X + n, _G)


@pytest.mark.parametrize("kern,cached", [(_toy_ok, True), (_toy_dns, True), (_toy_dnsa, False),
                                         (_toy_global, False)],
                         ids=["modelled", "do_not_specialize", "no_alignment_specialisation", "reads_a_global"])
def test_only_modelled_kernels_are_cached(fake_gpu, monkeypatch, kern, cached):
    """Kernels whose specialisation the key does not model stay on Triton's path (its global check included)."""
    monkeypatch.setattr(kern, "device_caches", defaultdict(kern.create_binder))
    monkeypatch.setattr(kern, "_do_compile", fake_gpu.do_compile(kern))
    x = torch.zeros(4)
    for _ in range(2):
        fl.launch(kern, (1, ), (x, 5), dict(C=2))
    assert (fake_gpu.normalised(1)[3] == (None, None, None)) == cached


def test_do_not_specialize_values_share_one_compile(fake_gpu, monkeypatch):
    """A ``do_not_specialize`` int takes one compile for 1, 16 and 17 (Triton's three specialisations otherwise),
    each cached launch checked against Triton's own binder and cache ("verify"), its value passed through."""
    monkeypatch.setattr(_toy_dns, "device_caches", defaultdict(_toy_dns.create_binder))
    monkeypatch.setattr(_toy_dns, "_do_compile", fake_gpu.do_compile(_toy_dns))
    x = torch.zeros(4)
    before = fl.VERIFIED
    for n in (1, 16, 17, 1):
        fl.launch(_toy_dns, (1, ), (x, n), dict(C=2))
    assert len(fake_gpu.compiled) == 1 and fl.VERIFIED - before == 3
    assert [fake_gpu.normalised(i)[2][1] for i in range(4)] == [1, 16, 17, 1]


def test_other_triton_versions_take_kernel_grid(fake_gpu, monkeypatch):
    """The launcher convention is copied from 3.6: another version never uses the cache (until checked)."""
    monkeypatch.setattr(fl, "_VERSIONS", ("9.9.", ))
    monkeypatch.setattr(fl, "_TRITON", False)
    c = _case()
    for _ in range(2):
        _fwd(c)
    assert fake_gpu.normalised(1)[3][1] is knobs.runtime.launch_enter_hook and not fl._CACHES


def test_fused_check_is_cached_with_the_same_launch(fake_gpu, monkeypatch):
    """The jagged-input check kernel (``debug=True``, its sizes ``do_not_specialize``, ``ok_out`` None) goes through
    the cache from its second call: one compile across batch sizes, the launcher given what Triton gives it."""
    from triton.runtime.jit import JITFunction

    from hstu_inductor.kernels import checks

    # the kernel as a GPU build sees it (the test session's kernels are the interpreter's)
    src = getattr(checks._check_jagged_kernel, "fn", checks._check_jagged_kernel)
    kern = JITFunction(src, debug=True, do_not_specialize=checks._SIZES)
    monkeypatch.setattr(checks, "_check_jagged_kernel", kern)
    monkeypatch.setattr(kern, "device_caches", defaultdict(kern.create_binder))
    monkeypatch.setattr(kern, "_do_compile", fake_gpu.do_compile(kern))
    for nt in (None, torch.tensor([1, 0, 2])):
        fake_gpu.launches.clear()
        off = torch.tensor([0, 3, 3, 9])
        for L, N in ((9, 16), (9, 17), (9, 1)):
            checks.check_jagged(off, L, N, nt)
        heads = [fake_gpu.normalised(i) for i in range(3)]
        assert heads[0][3][1] is knobs.runtime.launch_enter_hook  # Triton's own first launch
        assert all(h[3] == (None, None, None) for h in heads[1:])  # then cached
        assert [h[2][5] for h in heads] == [16, 17, 1] and all(h[2][2] is None for h in heads)
        assert heads[0][2][:5] == heads[1][2][:5]
    assert len(fake_gpu.compiled) == 2  # with and without targets; no compile per size

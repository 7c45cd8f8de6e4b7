"""Bounded probe of the 'CUDA .pt2 segfaults on load' problem on the device machines.

Builds a one-op CUDA package (``x.sin() + 1``) under several AOTInductor settings and loads each
in a fresh process, printing the exit code. Usage: python3 benchmarks/aoti_cuda_load_probe.py OUTDIR
"""
import os
import subprocess
import sys

import torch

VARIANTS = {
    "default": {},
    "embed_kernel_binary": {"aot_inductor.embed_kernel_binary": True},
    "no_cubin_store": {"triton.store_cubin": False},
    "constants_outside_so": {"aot_inductor.package_constants_in_so": False},
    "single_threaded_runner": {},  # loaded with run_single_threaded=True below
}


class M(torch.nn.Module):
    def forward(self, x):
        return x.sin() + 1


def main(out):
    os.makedirs(out, exist_ok=True)
    x = torch.randn(64, device="cuda")
    for name, cfg in VARIANTS.items():
        path = os.path.join(out, f"{name}.pt2")
        try:
            ep = torch.export.export(M(), (x,))
            torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=cfg)
        except Exception as e:  # a setting this torch does not know
            print(f"{name:24s} build failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        kw = "run_single_threaded=True" if name == "single_threaded_runner" else ""
        code = (f"import torch; m = torch._inductor.aoti_load_package({path!r}{', ' + kw if kw else ''}); "
                f"print(float(m(torch.ones(64, device='cuda')).sum()))")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        print(f"{name:24s} load rc={p.returncode} out={p.stdout.strip()[:40]} err={p.stderr.strip()[-160:]!r}")
    # Is the crash in loading the .so at all? dlopen it directly with ctypes.
    import ctypes
    import zipfile
    with zipfile.ZipFile(os.path.join(out, "default.pt2")) as z:
        so = [n for n in z.namelist() if n.endswith(".so")]
        z.extractall(os.path.join(out, "unz"))
    code = f"import ctypes; ctypes.CDLL({os.path.join(out, 'unz', so[0])!r}); print('dlopen ok')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print(f"{'plain dlopen of .so':24s} rc={p.returncode} {p.stdout.strip()} {p.stderr.strip()[-200:]!r}")
    code = (f"import torch, ctypes; ctypes.CDLL({os.path.join(out, 'unz', so[0])!r}); print('dlopen after torch ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print(f"{'dlopen after torch':24s} rc={p.returncode} {p.stdout.strip()} {p.stderr.strip()[-200:]!r}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/aoti_probe")

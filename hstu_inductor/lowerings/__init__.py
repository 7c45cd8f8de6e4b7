"""How Inductor and AOTInductor lower ``torch.ops.hstu.*`` (design note; no code lives here yet).

The hstu ops are ``torch.library.triton_op`` s (``hstu_inductor/ops``) whose bodies launch the
Triton kernels of ``hstu_inductor.kernels`` through ``torch.library.wrap_triton`` on CUDA and run
plain ATen (the eager reference) elsewhere. Consequences:

* AOTAutograd decomposes each op into its body, so Inductor's generated code - and an
  AOTInductor package - contains our kernels as user-defined Triton kernels (or ATen on CPU),
  with no call back into Python; ``torch.export`` keeps the ops as single nodes.
* No private Inductor API (``register_lowering``, ``TritonTemplate``) is needed, which keeps the
  design stable from torch 2.11 to 2.13+. The one version-sensitive helper, the symbolic-shape
  query used while tracing the kernels' host code, lives in ``hstu_inductor._compat``.

This package is where Inductor lowerings/templates would go if autotuning the kernels *inside*
Inductor's own template selection (e.g. TMA and non-TMA variants as template choices) proves
worth it; measurements that motivate it are in ``benchmarks/RESULTS.md``.
"""

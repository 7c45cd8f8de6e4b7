"""How Inductor and AOTInductor lower ``torch.ops.hstu.*``.

Current state: the hstu ops are opaque ``torch.library.custom_op`` s, so Inductor emits a fallback
call to their CUDA implementation (which launches the Triton kernels of ``hstu_inductor.kernels``)
and schedules its own fused code around it. Moving the kernels *into* Inductor's generated code
(``triton_op`` + ``wrap_triton``, needed for AOTInductor packages that load without Python) is
tracked by the lowerings/AOTI issue.
"""

"""Custom ops in the ``hstu`` namespace (``torch.ops.hstu.*``): schemas, fake impls, autograd.

Importing this package registers: ``attention``, ``attention_bwd``, ``delta_attention``,
``stu_preprocess`` (+ ``_bwd``) and ``stu_output`` (+ ``_bwd``).
"""
from .attention import attention, attention_bwd, delta_attention
from .stu import stu_output, stu_preprocess

__all__ = ["attention", "attention_bwd", "delta_attention", "stu_output", "stu_preprocess"]

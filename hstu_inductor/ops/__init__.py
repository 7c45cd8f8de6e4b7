"""Custom ops in the ``hstu`` namespace (``torch.ops.hstu.*``): schemas, fake impls, autograd.

Importing this package registers: ``attention``, ``attention_bwd``, ``attention_bwd_rab``, ``delta_attention``,
``stu_preprocess`` (+ ``_save``, ``_bwd``), ``stu_output`` (+ ``_save``, ``_bwd``) and ``time_bucket_map``.
``preprocess_views`` takes the STU's ``(u, v, q, k)`` from ``stu_preprocess``'s outputs as views.
"""
from .attention import attention, attention_bwd, attention_bwd_rab, delta_attention
from .bucket_map import time_bucket_map
from .stu import preprocess_views, stu_output, stu_output_save, stu_preprocess, stu_preprocess_save

__all__ = ["attention", "attention_bwd", "attention_bwd_rab", "delta_attention", "preprocess_views", "stu_output",
           "stu_output_save", "stu_preprocess", "stu_preprocess_save", "time_bucket_map"]

"""Triton kernels for HSTU (jagged attention). Import is cheap; kernels compile on first use."""
from .attention import delta_hstu_attention_fwd, hstu_attention_bwd, hstu_attention_fwd, tma_supported

__all__ = ["hstu_attention_fwd", "hstu_attention_bwd", "delta_hstu_attention_fwd", "tma_supported"]

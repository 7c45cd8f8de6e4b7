"""Eager PyTorch semantic reference for HSTU (see HSTU_SEMANTICS.md); plain torch ops only."""
from .attention import delta_hstu_mha, hstu_mha, hstu_mha_backward, validate_attention_inputs, validate_rab_intervals, \
    validate_rab_tables
from .jagged import jagged_to_padded, lengths_from_offsets, padded_to_jagged, row_to_sequence, validate_jagged
from .mask import hstu_mask, interval_mask, position_ids, sla_intervals
from .rab import relative_bias, relative_bias_backward, time_buckets
from .stu import HSTUModel, STULayer, stu_layer, stu_output, stu_preprocess

__all__ = [
    "delta_hstu_mha", "hstu_mha", "hstu_mha_backward", "validate_attention_inputs", "validate_rab_intervals", "validate_rab_tables",
    "jagged_to_padded", "lengths_from_offsets", "padded_to_jagged", "row_to_sequence", "validate_jagged", "hstu_mask",
    "interval_mask", "position_ids", "sla_intervals", "HSTUModel", "STULayer", "stu_layer", "stu_output",
    "stu_preprocess", "relative_bias", "relative_bias_backward", "time_buckets",
]

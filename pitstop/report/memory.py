"""The memory estimate's names where `pitstop estimate` and its tests import them.

The model lives in `pitstop.measure.cost_model` (one cost model below the report and
the doctor); this module only re-exports it.
"""

from __future__ import annotations

from pitstop.measure.cost_model import (
    COMPUTE_BYTES,
    FP32,
    NF4_BYTES_PER_PARAM,
    OPTIM_8BIT_BYTES_PER_PARAM,
    MemoryEstimate,
    ModelShape,
    ParamCounts,
    activation_bytes_per_token_layer,
    estimate_memory,
    lora_params,
    max_micro_batch,
    shape_from_config,
    shape_from_model_dir,
    shape_from_params,
    sharded,
)

__all__ = [
    "COMPUTE_BYTES",
    "FP32",
    "NF4_BYTES_PER_PARAM",
    "OPTIM_8BIT_BYTES_PER_PARAM",
    "MemoryEstimate",
    "ModelShape",
    "ParamCounts",
    "activation_bytes_per_token_layer",
    "estimate_memory",
    "lora_params",
    "max_micro_batch",
    "shape_from_config",
    "shape_from_model_dir",
    "shape_from_params",
    "sharded",
]

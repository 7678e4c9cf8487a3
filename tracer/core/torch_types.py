"""The torch-level types every PyTorch engine shares, without importing the reimplementation:
the `dtype` knob's values as torch dtypes, and the signature of a point recorder."""

from __future__ import annotations

from typing import Callable

import torch

# `dtype` knob value (tracer.model.knobs.DTYPES) -> torch dtype
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}

# What the forward (tracer.reimpl.forward) and the hooks (tracer.hooks) call once per point: record(name, tensor).
Recorder = Callable[[str, torch.Tensor], None]

"""The one map from the config's dtype names to torch dtypes (trainer, shared layout, exports)."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

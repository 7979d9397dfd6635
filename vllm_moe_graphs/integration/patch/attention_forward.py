"""Patch: `forward` of eligible Qwen3 / Qwen3-MoE attention modules (instance attributes).

Why: with `fuse_qk_norm_rope` one fused kernel applies the q/k RMSNorm and RoPE
(`integration/model/qk_norm_rope.py`), replacing the three launches of vLLM's
`Qwen3Attention.forward` between the QKV projection and the attention; the model code offers no
seam between those steps.
How: `install` binds the fused forward to the module object (an instance attribute that
shadows the class method for that module only); modules the fused op cannot serve keep vLLM's.
Removal: when vLLM's Qwen3 attention uses `fused_qk_norm_rope` itself.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


def install(module: Any, forward: Callable[..., Any]) -> None:
    module.forward = types.MethodType(forward, module)

"""Patch: `forward` of eligible model modules (instance attributes): Qwen3 / Qwen3-MoE attention,
RMSNorm, SiLU-and-mul.

Why: with `fuse_qk_norm_rope` one fused kernel applies the q/k RMSNorm and RoPE
(`integration/model/qk_norm_rope.py`), replacing the three launches of vLLM's
`Qwen3Attention.forward` between the QKV projection and the attention; the model code offers no
seam between those steps. With `compiled_numerics` the residual-stream RMSNorms and the dense
MLP's SiLU-and-mul round as stock vLLM's compiled model does (`integration/model/
compiled_numerics.py`); vLLM picks their kernels per process (IR op priority, CustomOp
dispatch), not per model.
How: `install` binds the new forward to the module object (an instance attribute that
shadows the class method for that module only); modules the new forward cannot serve keep
vLLM's.
Removal: when vLLM's Qwen3 attention uses `fused_qk_norm_rope` itself, and when vLLM's
uncompiled RMSNorm and SiLU-and-mul round as its compiled ones do.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


def install(module: Any, forward: Callable[..., Any]) -> None:
    module.forward = types.MethodType(forward, module)

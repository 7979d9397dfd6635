"""Patch: `quant_method` of eligible unquantized linear layers (instance attributes).

Why: with `small_m_gemm` the plugin's small-M GEMM kernel serves the decode-sized matmuls of
the dense linear layers (`integration/model/small_m_linear.py`); vLLM's `LinearBase.forward` calls
`self.quant_method.apply(self, x, bias)`, which is the one place a layer's matmul can be
replaced without touching the model code.
How: `install` sets the layer object's `quant_method` to a `SmallMLinearMethod` (a subclass of
vLLM's `UnquantizedLinearMethod`, so every other use of the attribute behaves as before); only
layers whose method is exactly `UnquantizedLinearMethod` are eligible. Weights are untouched.
Removal: when vLLM selects a GEMM per batch size for unquantized layers (or cuBLAS's small-M
GEMMs reach HBM bandwidth).
"""

from __future__ import annotations

from typing import Any

ATTRIBUTE = "quant_method"


def install(layer: Any, method: Any) -> None:
    setattr(layer, ATTRIBUTE, method)

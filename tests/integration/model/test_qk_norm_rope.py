"""The opt-in fused q/k RMSNorm + RoPE (`integration/model/qk_norm_rope.py`).

CPU tier: a real vLLM Qwen3 model (CPU build of vLLM): which modules qualify and why not, and
that a build without the fused op leaves every module exactly as vLLM built it. GPU tier: the
fused forward against vLLM's own unfused q_norm / k_norm / rotary_emb on real vLLM layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.gpu_util import require_cuda_and_vllm
from tests.serve_util import QWEN3_BUILD, run_result_script
from vllm_moe_graphs.config import PluginConfig

_BUILD = QWEN3_BUILD + r"""
from vllm_moe_graphs.integration.model import qk_norm_rope as qnr

def attn(model):
    return [m for n, m in model.named_modules() if n.endswith("self_attn")]

bf16 = build(64, "bfloat16", port=int(sys.argv[1]))
fp32 = build(64, "float32")
odd = build(32, "bfloat16")
out = {
    "op_available": qnr.op_available(),
    "bf16": [qnr.refusal(m) for m in attn(bf16)],
    "fp32": [qnr.refusal(m) for m in attn(fp32)],
    "head32": [qnr.refusal(m) for m in attn(odd)],
    "installed": qnr.install_fused_qk_norm_rope(bf16),
    "forward_untouched": all("forward" not in m.__dict__ for m in attn(bf16)),
    "no_qwen3": qnr.install_fused_qk_norm_rope(torch.nn.Linear(2, 2)),
}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def built(cpu_vllm) -> dict:
    return run_result_script(_BUILD, cpu_vllm)


def test_refusals_name_what_the_kernel_lacks(built) -> None:
    assert built["bf16"] == [None, None]  # head_dim 64, bf16, vLLM's RotaryEmbedding, RMSNorm
    assert all(r == "dtype torch.float32 (fp16 / bf16 only)" for r in built["fp32"]), built
    assert all(r.startswith("head_dim 32 (supported: (64, 128, 256))") for r in built["head32"])


def test_without_the_op_every_module_stays_as_vllm_built_it(built) -> None:
    assert built["op_available"] is False  # the CPU build of vLLM has no fused_qk_norm_rope
    assert built["installed"] == {
        f"model.layers.{i}.self_attn": "torch.ops._C.fused_qk_norm_rope is not in this vLLM build"
        for i in range(2)}
    assert built["forward_untouched"] and built["no_qwen3"] == {}


def test_fuse_qk_norm_rope_is_on_by_default_and_parsed() -> None:
    assert PluginConfig().fuse_qk_norm_rope is True
    assert PluginConfig.from_dict({"fuse_qk_norm_rope": True}).fuse_qk_norm_rope is True


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 4)])  # 0.6B, 30B-A3B
def test_fused_forward_matches_vllms_unfused_path(num_heads, num_kv_heads) -> None:
    require_cuda_and_vllm()
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from vllm_moe_graphs.integration.model import qk_norm_rope as qnr

    if not qnr.op_available():
        pytest.skip("this vLLM build has no torch.ops._C.fused_qk_norm_rope")
    dev, dt, d, tokens = torch.device("cuda"), torch.bfloat16, 128, 37
    gen = torch.Generator(device=dev).manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        q_norm, k_norm = RMSNorm(d, eps=1e-6).to(dev, dt), RMSNorm(d, eps=1e-6).to(dev, dt)
        rope = get_rope(d, max_position=4096, rope_parameters={"rope_theta": 1e6,
                                                               "rope_type": "default"},
                        dtype=dt).to(dev)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=gen, device=dev))
        k_norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=gen, device=dev))
    q_size, kv_size = num_heads * d, num_kv_heads * d
    module = SimpleNamespace(
        qkv_proj=lambda h: (h.clone(), None), attn=lambda q, k, v: torch.cat([q, k, v], -1),
        o_proj=lambda x: (x, None), rotary_emb=rope, q_norm=q_norm, k_norm=k_norm,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=d, q_size=q_size,
        kv_size=kv_size)
    assert qnr.refusal(module) is None
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen, device=dev, dtype=dt)
    positions = torch.randint(0, 4000, (tokens,), generator=gen, device=dev)
    with torch.no_grad():
        fused = qnr.fused_forward(module, positions, qkv)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q_norm(q.reshape(tokens, num_heads, d)).reshape(tokens, q_size)
        k = k_norm(k.reshape(tokens, num_kv_heads, d)).reshape(tokens, kv_size)
        q, k = rope(positions, q, k)
        ref = torch.cat([q, k, v], -1)
    torch.testing.assert_close(fused, ref, atol=3e-2, rtol=2e-2)
    assert torch.equal(fused[:, q_size + kv_size:], qkv[:, q_size + kv_size:])  # v untouched

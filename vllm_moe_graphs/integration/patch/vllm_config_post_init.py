"""Patch: `vllm.config.VllmConfig.__post_init__`.

Why: for an eligible Qwen3 / Qwen3-MoE setup the plugin takes decode graphs over: our worker and
V1 model runner, our attention backend, vLLM's own capture off and
no torch.compile. Those choices must be made *before* vLLM settles the config (custom ops, IR op
priorities and capture sizes are derived from the compilation mode inside `__post_init__`), so
the edit runs first and vLLM derives everything else from it, exactly as if the user had passed
the flags of the explicit route (docs/architecture.md, the take-over).
The user's compilation choices (`-O<n>`, `-cc.mode`, `-cc.cudagraph_mode`) are readable only
here, before vLLM derives them from the level: they are kept on the config object
(`config_facts.USER_COMPILATION_ATTR`) for every later capability check, in every process.
How: the method is wrapped; the user's compilation choices are recorded and
`hooks.before_engine_config` edits the still-unsettled config, then the original runs unchanged.
Removal: when vLLM offers a pre-finalisation config hook for general plugins.
"""

from __future__ import annotations

from vllm_moe_graphs.integration.patch import PATCHED_ATTR
from vllm_moe_graphs.integration.signatures import check_parameters

QUALNAME = "vllm.config.VllmConfig.__post_init__"


def apply() -> str | None:
    from vllm.config import VllmConfig

    original = VllmConfig.__post_init__
    if getattr(original, PATCHED_ATTR, False):
        return None
    check_parameters(QUALNAME, original, ("self",))

    def __post_init__(self):  # noqa: N807
        from vllm_moe_graphs.integration import config_facts, hooks

        setattr(self, config_facts.USER_COMPILATION_ATTR,
                config_facts.read_user_compilation(self))
        hooks.before_engine_config(self)
        original(self)

    __post_init__.__wrapped__ = original
    setattr(__post_init__, PATCHED_ATTR, True)
    VllmConfig.__post_init__ = __post_init__
    return QUALNAME

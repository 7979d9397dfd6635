"""`GraphLifecycle`: everything the plugin keeps for one V1 model runner, behind one public API.

`MoeGraphsModelRunner` forwards vLLM's calls here and holds nothing else of ours. This object
owns the KV storage binding, the `DecodeGraphRunner` and its per-step plan, the plugin's decode
inputs, in-graph logits and sampler graphs, and the start-up work (kernel warm-up, precapture):

    lifecycle = GraphLifecycle(runner, config)          # the runner's __init__
    lifecycle.register(model)                           # load_model: classify, install kernels
    lifecycle.bind(Phase.SERVING); lifecycle.start()    # initialize_kv_cache (serving)
    lifecycle.unbind(why) / revalidate(event) / drop_graphs(event) / rebind(why)
    lifecycle.begin_step() ... end_step()               # execute_model (or `with step()`)
        lifecycle.prepare_inputs(...)                   #   _prepare_inputs (pure decode)
        rows = lifecycle.plan(...)                      #   _determine_batch_execution_and_padding
        lifecycle.builds_metadata()                     #   _build_attention_metadata
        lifecycle.forward(args)                         #   _model_forward (consumes the plan)
    lifecycle.sample(logits, spec)                      # sample_tokens -> _sample
    lifecycle.capture_model()                           # warm-up, precapture
    with lifecycle.capturing(key): ...                  # precapture's dummy batch for `key`
    lifecycle.close()                                   # shutdown

When vLLM makes these calls: the lifecycle table in `integration/runner/model_runner.py`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_moe_graphs import metrics
from vllm_moe_graphs.capability import Reason
from vllm_moe_graphs.graphs.buckets import context_coverage, graph_config
from vllm_moe_graphs.graphs.kinds import StepKind, step_kind
from vllm_moe_graphs.graphs.plan import StepPlan, StepScope, key_padding
from vllm_moe_graphs.graphs.runner import Action, Decision, DecodeGraphRunner
from vllm_moe_graphs.integration.runner import buffers
from vllm_moe_graphs.integration.runner.decode_inputs import DecodeInputs, pure_decode, unsupported
from vllm_moe_graphs.integration.runner.graph_sampling import GraphSampling, install_graph_sampling
from vllm_moe_graphs.integration.model.graph_logits import install_graph_logits
from vllm_moe_graphs.integration.model.moe_padding import MoePadding, key_scope
from vllm_moe_graphs.kv.storage import PagedKVStorage, Phase

if TYPE_CHECKING:
    from vllm_moe_graphs.config import PluginConfig
    from vllm_moe_graphs.graphs.buckets import GraphKey
    from vllm_moe_graphs.integration.model.graph_logits import GraphLogits
    from vllm_moe_graphs.integration.model.registry import AttentionLayerRegistry
    from vllm_moe_graphs.metrics import MetricsRecorder

logger = logging.getLogger("vllm.moe_graphs")


class GraphLifecycle:
    """The plugin's state for one model runner (see the module docstring)."""

    def __init__(self, runner: Any, config: PluginConfig,
                 storage: PagedKVStorage | None = None) -> None:
        self._runner = runner
        self.config = config
        self.storage = storage if storage is not None else PagedKVStorage(
            metrics=metrics.recorder())
        self.layers: AttentionLayerRegistry | None = None
        self.graphs: DecodeGraphRunner | None = None
        self.inputs: DecodeInputs | None = None  # fast_decode_inputs, once serving is bound
        self.logits: GraphLogits | None = None  # logits_in_graph, with `inputs`
        self.sampling: GraphSampling | None = None  # sample_in_graph, with `graphs`
        self.linear: dict[str, Any] = {}  # small_m_gemm: layer name -> SmallMLinearMethod
        self.fused_attn: dict[str, str] = {}  # fuse_qk_norm_rope: module -> fused or why not
        self.norms: dict[str, str] = {}  # compiled_numerics: module -> installed or why not
        self.moe_padding: MoePadding | None = None  # skip_moe_padding, for an MoE model
        self.lean_replay = False  # a replay may skip the attention metadata (`builds_metadata`)
        self.idle_settled = False  # idle_capture said it has nothing left (precapture.py)
        self._kv_watch: tuple[tuple[Any, torch.Tensor], ...] = ()  # (layer, bound tensor)
        self._step: StepScope | None = None
        self._capturing: GraphKey | None = None
        self._real_model: Any = None  # the model while `capturing` swaps in the precapture shim
        self._recorder: MetricsRecorder | None = None  # this process' metrics, at first publish
        self.metadata_builders: list[Any] = []  # ours among vLLM's (bound with the storage)

    # -- model and KV storage --------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The model (the real one, also while `capturing` swaps the runner's)."""
        return self._real_model if self._real_model is not None else self._runner.model

    def register(self, model: Any) -> None:
        """Classify the loaded model's layers; install the configured kernels where it holds."""
        from vllm_moe_graphs.integration.model.registry import register_model

        self.layers = register_model(model)
        proof = self.layers.proof()
        logger.info("moe_graphs: model layers %s%s", proof.reason.value,
                    f" ({proof.detail})" if proof.detail else "")
        if self.config.enabled and proof.holds:
            from vllm_moe_graphs.integration.model.kernels import install_kernels

            k = install_kernels(model, self._runner, self.config)
            self.linear, self.fused_attn, self.norms = k.linear, k.fused_attn, k.norms
            self.moe_padding = k.moe_padding

    def bind(self, phase: Phase) -> None:
        """Bind the storage to the KV tensors vLLM bound to our layers (else log why not)."""
        layers, r = self.layers, self._runner
        if not self.config.enabled or layers is None:
            return
        if not (proof := layers.proof()).holds:
            logger.info("moe_graphs: KV storage not bound (%s: %s)", proof.reason.value,
                        proof.detail)
            return
        indices = layers.layer_indices
        kv = buffers.kv_tensors(r, indices)
        if set(kv) != set(indices):
            logger.warning("moe_graphs: KV storage not bound: vLLM bound no KV tensor for %s",
                           sorted(set(indices) - set(kv)))
            return
        try:
            identity = self.storage.bind(kv, phase=phase, layer_indices=indices,
                                         buffers=buffers.graph_buffers(r))
        except ValueError as exc:  # e.g. another attention backend's layout: stock vLLM runs
            logger.warning("moe_graphs: KV storage not bound (%s phase): %s", phase.value, exc)
            return
        model_device = next((p.device for p in self.model.parameters()), r.device)
        self.storage.check_devices(r.device, model_device)
        if not (match := layers.match_storage(identity)).holds:
            self.storage.invalidate(match.detail)
        self.watch_kv(kv)
        self.lean_replay = buffers.read_metadata_in_place(r)
        self.metadata_builders = buffers.our_metadata_builders(r)
        logger.info("moe_graphs: KV storage bound (%s phase, %d layers, generation %d): %s",
                    phase.value, len(kv), self.storage.generation,
                    self.storage.proof().reason.value)

    def watch_kv(self, kv: dict[str, torch.Tensor]) -> None:
        """Watch each layer's bound tensor: `kv_rebound` compares identities per step."""
        ctx = self._runner.compilation_config.static_forward_context
        self._kv_watch = tuple((ctx[name], t) for name, t in kv.items())

    def unbind(self, why: str) -> None:
        if not self.storage.closed:
            self.storage.unbind(why)

    def kv_rebound(self) -> bool:
        """True when some attention layer no longer holds the tensor the storage bound: one
        identity check per layer (host only), so a swap is caught before the next replay."""
        return any(layer.kv_cache is not t for layer, t in self._kv_watch)

    def rebind(self, why: str) -> None:
        """The storage's identity no longer matches vLLM's tensors: invalidate (metrics, graphs
        dropped through the listener), then bind afresh to what vLLM holds now."""
        if self.storage.closed:
            return
        logger.warning("moe_graphs: %s; graphs dropped, rebinding", why)
        self.storage.invalidate(why)
        self.bind(Phase.SERVING)

    def revalidate(self, event: str) -> None:
        """After `event` (wake-up, reload): compare vLLM's tensors with the bound identity."""
        if self.storage.closed or not self.storage.bound:
            return
        names = self.storage.identity().layer_indices
        proof = self.storage.revalidate(buffers.kv_tensors(self._runner, names),
                                        buffers.graph_buffers(self._runner))
        logger.info("moe_graphs: KV storage after %s: %s%s", event, proof.reason.value,
                    f" ({proof.detail})" if proof.detail else "")
        if proof.reason is Reason.STORAGE_IDENTITY_CHANGED:
            self.rebind(f"KV storage changed at {event}")

    def drop_graphs(self, event: str) -> None:
        """Drop every decode graph (and sampler graph) for a lifecycle event the KV identity does
        not show (sleep discards contents at the same addresses; a reload may move weights);
        counted in `moe_graphs_invalidations_total{reason="storage_identity_changed"}`."""
        if self.sampling is not None:
            self.sampling.drop()
        if self.graphs is None or self.graphs.closed:
            return
        self.graphs.invalidate(Reason.STORAGE_IDENTITY_CHANGED, event)
        metrics.recorder().record_invalidation(Reason.STORAGE_IDENTITY_CHANGED)
        self.publish()

    def start(self) -> None:
        """Once the serving bind holds: record the runtime capability, then create the graph
        runner, the decode inputs and the in-graph logits where eligible and configured."""
        from vllm_moe_graphs.integration import hooks
        from vllm_moe_graphs.killswitch import KillSwitch

        r, c = self._runner, self.config
        proof = self.storage.proof()
        own = r.compilation_config.cudagraph_mode
        vllm_graphs = own is not None and own.name != "NONE"
        if proof.holds and vllm_graphs:
            logger.warning("moe_graphs: vLLM's own CUDA graphs are on (cudagraph_mode=%s); the "
                           "plugin's graphs stay off (see docs/architecture.md, the take-over)", own.name)
        report = hooks.record_capability(r.vllm_config, metrics.process_rank(), proof,
                                         graphs_on=proof.holds and not vllm_graphs)
        if self.graphs is None and report.eligible and not vllm_graphs:
            config = graph_config(c, r.max_num_reqs, r.max_model_len, r.max_num_tokens)
            self.graphs = DecodeGraphRunner(None, config, storage=self.storage,
                                            kill_switch=KillSwitch.from_env(),
                                            decode_plan=buffers.decode_split_plan(r))
            self.graphs.set_scratch_bytes(sum(
                t.numel() * t.element_size() for t in buffers.graph_buffers(r).values()))
            for line in self.graphs.describe():
                logger.info("moe_graphs: %s", line)
            if (uncovered := context_coverage(c.context_buckets, r.max_model_len)) is not None:
                logger.warning("moe_graphs: %s", uncovered)
        if c.fast_decode_inputs and self.graphs is not None and self.inputs is None:
            why = unsupported(r)
            self.inputs = DecodeInputs(r) if why is None else None
            logger.info("moe_graphs: decode inputs prepared by %s",
                        f"vLLM ({why})" if why else "the plugin (fast_decode_inputs)")
        if c.logits_in_graph and self.inputs is not None and self.logits is None:
            self.logits = install_graph_logits(self.model, self.graphs)
        if c.sample_in_graph and self.graphs is not None and self.sampling is None:
            self.sampling = install_graph_sampling(r, self.logits, self.graphs)
        self.publish()

    def close(self) -> None:
        if self.sampling is not None:
            self.sampling.drop()
        if self.graphs is not None:
            self.graphs.close()
            self.publish()
        self.storage.close()

    def publish(self) -> None:
        """Publish the graph runner's counters (`GraphStats`) as this process' metrics."""
        if self.graphs is not None:
            self._recorder = self._recorder or metrics.recorder()
            self._recorder.publish(self.graphs.stats)

    # -- one engine step -------------------------------------------------------------------------
    def begin_step(self) -> StepScope:
        """Open the scope of one `execute_model`: outside it (vLLM's profile and warm-up dummy
        runs) nothing is planned, padded or graphed. Close it with `end_step`."""
        self._step = StepScope()
        return self._step

    def end_step(self) -> None:
        self._step = None
        buffers.plan_builders(self.metadata_builders, None)
        if self.logits is not None:
            self.logits.clear()
        self.publish()  # after the step: never inside a captured region

    @contextlib.contextmanager
    def step(self) -> Iterator[StepScope]:
        """`begin_step` ... `end_step` as a `with` block."""
        try:
            yield self.begin_step()
        finally:
            self.end_step()

    def prepare_inputs(self, scheduler_output: Any) -> tuple[Any, ...] | None:
        """A pure-decode step's inputs prepared by `DecodeInputs` (None: vLLM prepares them)."""
        step = self._step
        if step is None or self.inputs is None or not pure_decode(self._runner, scheduler_output):
            return None
        step.fast_inputs = True
        return self.inputs.prepare(self._runner, scheduler_output)

    def plan(self, num_tokens: int, num_reqs: int, query_lens: np.ndarray | None,
             max_query_len: int, use_cascade_attn: bool,
             force_eager: bool) -> tuple[int, int, bool] | None:
        """Plan the step vLLM is about to pad (host ints only: the scheduler's lengths; no GPU
        value is read). Returns (tokens, requests, uniform decode) to pad it to on a graph path
        (or precapture's dummy batch), or None: vLLM's own unpadded sizes."""
        if self.graphs is None:
            return None
        if self._capturing is not None:  # precapture's dummy batch, as a real step of the key
            buffers.plan_builders(self.metadata_builders, self._capturing)
            return key_padding(self._capturing)
        step = self._step
        if step is None:
            return None  # vLLM's dummy runs (profiling, warm-up) stay eager and unpadded
        kind = step_kind(num_tokens, num_reqs, max_query_len, query_lens)
        if self.sampling is not None:
            self.sampling.kind = kind
        decode = kind is StepKind.DECODE and not force_eager
        mixed = kind is not StepKind.DECODE and not force_eager and self.config.mixed_graphs
        max_context = int(self._runner.optimistic_seq_lens_cpu.numpy()[:num_reqs].max()) \
            if decode and not use_cascade_attn else 0
        if use_cascade_attn:  # vLLM's cascade plan is not ours: eager, whatever the kind
            d = Decision(Action.EAGER, None, Reason.CASCADE_ATTENTION, num_tokens)
        else:
            if (decode or mixed) and self.kv_rebound():
                self.rebind("a layer's KV tensor was rebound behind the storage")
            # Rows are query tokens: one per request in a decode step, all of them otherwise.
            d = self.graphs.decide(num_tokens, max_context, decode,
                                   requests=num_reqs if mixed else None)
        # NOTE: the LM head joins the forward of every padded step of a key that has it (fixed
        # per key for the engine's life); vLLM's compute_logits takes it for the exact view.
        step.plan = StepPlan(
            kind, d, max_context, fast_inputs=step.fast_inputs,
            with_logits=d.padded and self._logits_for(d.key),
            lean=self.lean_replay and step.fast_inputs and d.action is Action.REPLAY)
        buffers.plan_builders(self.metadata_builders, d.key if d.padded else None)
        return step.plan.padding

    def builds_metadata(self) -> bool:
        """Whether this step needs vLLM's attention metadata. A lean replay reads the persistent
        buffers the metadata would view (`buffers.read_metadata_in_place`); the build's
        one device write (null block ids in padded rows, seq_len 0) is never read."""
        step = self._step
        return step is None or step.plan is None or not step.plan.lean

    def forward(self, args: dict[str, Any]) -> torch.Tensor | None:
        """Run the planned step's forward through the graph runner (the plan is consumed);
        None when there is no plan: vLLM runs the model itself."""
        step = self._step
        plan = step.plan if step is not None else None
        if plan is None or self.graphs is None:
            return None
        step.plan = None
        d = plan.decision
        with key_scope(self.moe_padding, d.key if d.padded else None, d.num_reqs):
            out, _ = self.graphs.run(d, self._forward_fn(args, plan.with_logits), plan.kind)
        if plan.with_logits:
            self.logits.hand_over(out, plan.decision.num_reqs)
        return out

    def sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        """The step's `SamplerOutput` from a sampler graph (None: vLLM's sampler runs)."""
        return self.sampling.sample(logits, spec_decode_metadata) if self.sampling else None

    def bookkeeping(self, scheduler_output: Any, sampler_output: Any) -> tuple[Any, ...] | None:
        """A pure-decode step's bookkeeping by `DecodeInputs` (None: vLLM's)."""
        if self.inputs is None or not pure_decode(self._runner, scheduler_output):
            return None
        return self.inputs.bookkeeping(self._runner, sampler_output)

    # -- start-up --------------------------------------------------------------------------------
    def capture_model(self) -> int | None:
        """The kernel warm-up, then the precapture when configured; returns the pool bytes, or
        None when the graphs are off (vLLM's own capture_model runs)."""
        if self.graphs is None:
            return None
        from vllm_moe_graphs.integration.startup.precapture import precapture_all

        try:
            if self.sampling is not None:
                self.sampling.capture_all()
            return precapture_all(self._runner, self)
        finally:
            self.publish()

    @contextlib.contextmanager
    def capturing(self, key: GraphKey) -> Iterator[None]:
        """Inside the block the runner's model captures `key` when vLLM calls it, and vLLM's
        padding plans precapture's dummy batch as a real step of `key`: the uniform decode
        batch of a decode key's bucket, a key with prefill tokens' token and request buckets."""
        from vllm_moe_graphs.integration.patch import runner_model
        from vllm_moe_graphs.integration.startup.precapture import PrecaptureModel

        try:
            with runner_model.swapped(self._runner, PrecaptureModel(self, key)) as real:
                self._real_model, self._capturing = real, key
                yield
        finally:
            self._real_model, self._capturing = None, None
            buffers.plan_builders(self.metadata_builders, None)

    def capture(self, key: GraphKey, args: dict[str, Any]) -> torch.Tensor:
        """Capture `key` on the inputs vLLM prepared (`args`, the model's keyword arguments);
        returns its output, or the eager forward's when the capture was denied or failed."""
        with key_scope(self.moe_padding, key, key.batch_bucket):
            result = self.graphs.precapture([key], forward=self._forward_fn(
                args, self._logits_for(key)))[key]
        out = self.graphs.output(key) if result is Reason.ELIGIBLE else None
        return out if out is not None else self.model(**args)

    # -- internals -------------------------------------------------------------------------------
    def _forward_fn(self, args: dict[str, Any], with_logits: bool) -> Any:
        """The graph runner's forward for one step: the model on vLLM's (padded) inputs."""
        ids = args.get("input_ids")
        rows = ids.shape[0] if ids is not None else args["inputs_embeds"].shape[0]
        model, logits = self.model, self.logits if with_logits else None
        padding = self.moe_padding

        def forward(batch_size: int) -> torch.Tensor:
            assert rows >= batch_size, f"step has {rows} input rows, the runner asked {batch_size}"
            if padding is not None:
                padding.begin(rows)  # inside the graph: which rows skip the MoE experts
            hidden = model(**args)
            if logits is not None:
                logits.compute(hidden)
            return hidden

        return forward

    def _logits_for(self, key: GraphKey) -> bool:
        """Whether `key`'s graph computes the logits (fixed per key for the engine's life)."""
        return (self.logits is not None and key.decode
                and key.batch_bucket <= self.logits.buffer.shape[0])

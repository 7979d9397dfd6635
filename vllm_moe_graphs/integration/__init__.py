"""The thin integration layer: everything that imports vLLM internals lives here, so a port to a
newer vLLM changes only this package. Rooms by concern (each `__init__` says more); an arrow is
what a room may import, `tests/test_walls.py` checks it and that no import circle forms:

- root: `worker.py` (`MoeGraphsWorker`, the `--worker-cls` path) -> runner/, startup/, patch/;
  the engine-config glue `hooks.py`, `config_facts.py`, `signatures.py` (capability facts,
  take-over, checks that the private vLLM APIs we touch still look as expected) -> no room.
- `runner/`: the V1 model runner subclass and its per-step pipeline -> model/, attention/,
  startup/, patch/, the glue.
- `startup/`: warm-ups, precapture and idle capture, the model-info seed -> model/, patch/, the
  glue; the runner only through the protocols it declares.
- `model/`: model surgery (layer registry, small-M GEMM, fused q/k norm + RoPE, MoE padding,
  in-graph logits) -> patch/.
- `attention/`: vLLM attention backend glue over our kernels, and its registration -> no room.
- `patch/`: every monkeypatch of vLLM, one file per patched symbol -> the glue.

Nothing on the step path (runner/decode_inputs.py, runner/buffers.py, model/, attention/)
imports startup/. No `__init__` here imports anything: `register()` stays cheap.
"""

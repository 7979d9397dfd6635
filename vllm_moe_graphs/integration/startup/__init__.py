"""Start-up work, done before the engine serves: the kernel warm-ups (`moe_warm_up.py`,
`sampler_warm_up.py`, `sampling_variants.py`, also run as a subprocess with `python -m`),
precapture and idle capture (`precapture.py`), and the seed of vLLM's model-info cache
(`model_info_seed.py`, with its data `model_infos.json`).

May import model/ (for types), patch/ and the engine-config glue. It reaches the runner only
through the protocols it declares (`precapture.DummyBatchRunner`, `precapture.CaptureLifecycle`),
never by importing runner/, which imports this room. Nothing on the step path imports startup/.
"""

"""The serving benchmark, `python -m benchmarks.serving`: the run, merge and targets commands
(`bench`), the options and the plan they make (`options`), one real `vllm serve` per mode
(`server`), the open-loop load (`load`), rows, ratios, saturation and the plot (`report`), the
README's headline rows and the serving targets (`targets`).

Imports the harness, no other room.
"""

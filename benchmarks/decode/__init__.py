"""The fixed-batch decode benchmark, `python -m benchmarks.decode`: the run and merge commands
(`bench`), rows, ratios and tables (`report`), the cost of sampling beside greedy
(`sampling_cost`); and `python -m benchmarks.decode.host_phases`, a decode step's host phases on
any vLLM build (`host_phases`).

Imports the harness, no other room.
"""

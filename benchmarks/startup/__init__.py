"""The start-up benchmark, `python -m benchmarks.startup`: every mode started cold (new, empty
caches) and warm, each start in a fresh engine worker (`bench`).

Imports the harness, no other room.
"""

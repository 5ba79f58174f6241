"""The engine: continuous batching over a fixed pool of slots, rounds of fixed shapes, CUDA-graph replay.

One file per part: `slots.py` (slots and admission), `round.py` (the round's propose / verify / accept stages),
`graphs.py` (eager and captured round runners), `serve.py` (the driver loop), `run.py` (generate() on it),
`workload.py` (the closed-loop workload runner and `dspark bench`).
"""

"""The engine core, one file per part. It imports nothing above it (tests/test_layers.py); see docs/ARCHITECTURE.md.

The eager reference: `host.py` (host step), `compiled.py` (its decode steps through torch.compile'd layers, opt-in),
`rotary.py`, `kv_cache.py`, `sampling.py`, `acceptance.py`, `protocol.py` (drafter /
verifier contract), `decode.py` (the eager round loop: the oracle, and `generate`), `models.py` (the one
`load_host`), `packaged_hosts.py` (hosts shipped as registry wheels), `runtime.py`, `jsonio.py`.

The slot engine that `generate` runs by default: `slots.py` (slots and admission), `prefill.py` (the arrivals'
prefill, eager or as replayed CUDA graphs), `round.py` (the round's propose /
verify / accept stages), `graphs.py` (eager and CUDA-graph round runners), `serve.py` (the continuous-batching
driver), `run.py` (generate() on it), `workload.py` (the closed-loop workload runner behind `dspark bench`).
"""

"""The engine core: the round loop, the host step, KV cache, sampling, acceptance, model loading and the protocol
drafters and verifiers implement. It imports nothing above it (tests/test_layers.py); see docs/ARCHITECTURE.md."""

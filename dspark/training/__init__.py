"""Training: data, regeneration of responses by the host, and the drafter training loop. Imports the engine and
the methods, never the application (tests/test_layers.py)."""

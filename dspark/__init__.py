"""dspark: speculative decoding research toolkit centred on DSpark (confidence-scheduled, semi-autoregressive
drafting). See README.md."""
__version__ = "0.1.0"

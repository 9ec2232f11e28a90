"""kiln: from a causal LM and a versioned corpus to a gated, registered inference engine."""

__version__ = "0.1.0"

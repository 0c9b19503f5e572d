"""Adapters between serving engines and the SDK (transformers now; vLLM, SGLang, LMCache later)."""

"""Adapters between serving engines and the SDK: transformers (`transformers`), vLLM 0.33.0
(`vllm`), SGLang 0.5.23 (`sglang`) and LMCache 0.5.6 (`lmcache`). Each engine module imports its
engine, so import only the one whose engine is installed."""

"""KV events (vLLM's format) over ZMQ: publisher, bulk and curve parts, the workers' relay."""

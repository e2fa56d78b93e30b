"""DeepInfer: an LLM inference server with paged KV cache, continuous batching and a ZeroMQ service mesh."""

__version__ = "0.1.0"

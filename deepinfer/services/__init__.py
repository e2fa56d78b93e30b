"""One module per process role (router, tokenizer, prefill, decode, kvcache, balancer)."""

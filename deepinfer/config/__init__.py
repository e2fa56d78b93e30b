"""Configuration records, a leaf every layer may import: what a model is (`model`), the knobs of one engine
and every engine default (`engine`), and the KV cache's layout (`kv`)."""

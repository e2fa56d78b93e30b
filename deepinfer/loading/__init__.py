"""Getting a model onto a device: fetching the reference model (`fetch`), reading GGUF files (`gguf`,
`gguf_deepseek`), loading weights (`weights`, `packed_weights`), the model's identity for cache namespaces
(`identity`), and deriving the SmolLM2 mixture-of-experts test model (`derive_moe`, measured by `moe_report`)."""

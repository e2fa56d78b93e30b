"""Speculative decoding: guessers (`ngram`, `suffix`, `draft`), registered by kind (`registry`),
verification (`verify`), the controller that chooses how many tokens each request speculates
(`controller`). See `base`."""

"""Speculative decoding: guessers (`ngram`, `suffix`, `draft`), verification (`verify`), the
controller that chooses how many tokens each request speculates (`controller`). See `base`."""

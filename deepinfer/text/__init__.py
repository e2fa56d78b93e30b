"""Text: the tokenizer (tokenizer.json or a GGUF vocabulary, with the chat template) and the streaming
detokenizer."""

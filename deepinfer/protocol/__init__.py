"""The wire contract between services: message types, codec, framing, socket helpers."""

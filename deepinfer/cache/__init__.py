"""KV block identity and storage: hashing, the device block pool, host and disk tiers. No sockets."""

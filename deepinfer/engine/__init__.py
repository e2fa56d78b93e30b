"""What a worker runs: models, weights, tokenizer, scheduler, sampler, engine loop. No sockets."""

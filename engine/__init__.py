"""What runs on a device: model families, weight loading, tokenizer, the physical KV pool, workers."""

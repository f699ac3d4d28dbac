"""The paged, iteration-level engine: sequences, blocks, scheduling, KV cache, model runner, sampler."""

"""The model runtime: the forward, its KV cache and projection kernel, checkpoint loading and conversion."""

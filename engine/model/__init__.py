"""Our own Llama-family forward pass over a flat token batch and a paged KV cache."""

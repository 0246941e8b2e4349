"""loragate engine: one Llama-family base model served over a paged KV cache with continuous batching."""

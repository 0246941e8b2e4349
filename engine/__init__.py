"""loragate engine: one Llama-family base model, many LoRA adapters, served over a paged KV cache with
continuous batching. Needs the `engine` extra (torch and friends).

Parts: `core` (the step loop: requests, scheduler, waiting queue, preemption, the unified page pool),
`worker` (a step's flat batch, the model call, sampling), `model` (config, the Llama forward pass,
paged attention, weights, model sources), `lora` (PEFT rules, adapter files, registry and host cache,
the device tier, a step's LoRA batch) and `entrypoints` (the OpenAI HTTP API). docs/architecture.md
follows one request through them.
"""

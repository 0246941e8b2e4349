"""LoRA adapters: PEFT config rules, adapter files, registry and host cache, device tier, per-step batch."""

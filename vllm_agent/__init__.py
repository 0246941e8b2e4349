"""The vLLM agent (`loragate vllm-agent`): a sidecar beside a vLLM OpenAI server that fetches catalog adapters into a
disk cache and loads them into vLLM through its runtime LoRA API. vllm_agent/app.py documents its HTTP API. Torch-free:
it runs in the gateway's image."""

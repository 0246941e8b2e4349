"""The engine's HTTP entry points: OpenAI routes, protocol, responses, adapter routes, serving."""

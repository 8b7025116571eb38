"""The OpenAI surface: vLLM's OpenAI-compatible routes, relayed through the queue, and /v1/models."""

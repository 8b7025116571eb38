"""Model preparation: resolve a model name to a local folder that transformers and vLLM load."""

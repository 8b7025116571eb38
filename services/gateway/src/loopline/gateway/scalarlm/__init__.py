"""The ScalarLM surface: generate (batches in, results polled), health, and training (/v1/megatron/*:
submit, chunked upload, follow, cancel, delete), as ScalarLM's server answers its ``scalarlm`` client."""

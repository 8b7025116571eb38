"""Tensor-parallel full fine-tuning of Llama-family models with megatron-core's parallel layers.

Run one process per rank (``srun`` or ``torchrun``): ``python -m loopline.ml.parallel --job-dir DIR``.
The job directory's files are those of the single-process program (``loopline.ml.train``):
config.json and dataset.jsonlines in; status.json, events.jsonl and checkpoints out (rank 0).

Needs the ``megatron`` extra (megatron-core); importing this package itself does not.
"""

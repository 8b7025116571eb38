"""Loopline's Tinker session worker: a process (a Slurm job, or a local one under the local
launcher) that loads one base model and trains many Tinker clients' LoRA adapters on it, one call
at a time, in the order each client numbered its calls.

The trainer starts it (``python -m loopline.tinker_worker``, written into its entrypoint); it
speaks to the rest of Loopline only through NATS (``tinker.calls.<worker>`` in, futures, records
and session events out) and the jobs directory (sampler saves, for the checkpoint-watcher).
"""

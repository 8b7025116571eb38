"""Loopline checkpoint-watcher: finished checkpoints in the job directories -> adapters object store
-> ``checkpoints.<base>.<hash>`` on CHECKPOINTS. No torch here: safetensors headers are read
directly (validate.py).
"""

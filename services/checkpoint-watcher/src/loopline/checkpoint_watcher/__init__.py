"""Loopline checkpoint-watcher (issue 4): finished checkpoints -> adapters object store -> CHECKPOINTS."""

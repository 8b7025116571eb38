"""Loopline trainer service (issue 3): job registry, Slurm submission, job events."""

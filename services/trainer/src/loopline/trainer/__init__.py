"""Loopline trainer service: the training job registry, job submission to Slurm (or local
processes), reconciliation with the scheduler, and the job events users follow.

It never imports torch or loopline.ml: jobs run ``python -m loopline.ml.train`` in their own
processes."""

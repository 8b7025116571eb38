"""A training program's exit statuses, in a module of their own so that what must not import torch
(the program's entry before its lock is held, tests' stand-in programs) can name them."""

EXIT_COMPLETED = 0
EXIT_FAILED = 1
EXIT_PREEMPTED = 143  # 128 + SIGTERM, what Slurm and shells expect from a job stopped by TERM

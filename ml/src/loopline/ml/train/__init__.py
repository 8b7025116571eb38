"""The training program run inside each training job: `python -m loopline.ml.train --job-dir DIR`.

See docs/adapter-format.md for what it writes and config.py for the parameters it reads.
"""

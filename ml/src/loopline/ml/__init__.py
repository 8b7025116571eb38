"""Loopline ML: model preparation and the training program."""

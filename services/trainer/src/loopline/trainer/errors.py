"""Errors a trainer request can end with; each carries the HTTP status the gateway answers with.

They travel as nats.micro error replies: the status is the error code ("404"), the message the
description, so the gateway can pass both on to the client unchanged.
"""

from __future__ import annotations


class TrainerError(Exception):
    code = "500"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class JobNotFound(TrainerError):
    code = "404"


class WrongState(TrainerError):
    code = "409"


class CodeRefused(TrainerError):
    """The job ships its own ml/ code and this trainer does not run user code."""

    code = "403"


class InvalidRequest(TrainerError):
    """Bad params, an ambiguous job prefix, a missing dataset, an unsafe code archive."""

    code = "422"


class Unavailable(TrainerError):
    """The launcher or the object store did not answer; the caller may retry."""

    code = "503"

"""The job hash: what names a training job, and the one format it has everywhere.

ScalarLM names a job by the sha256 of the uploaded archive; its 1.151 SDK gzips that archive with the
mtime in the gzip header, so every resubmission of the same data becomes a new job. We hash what the
job is made of instead: the canonical params (``train_params.canonical``), the *uncompressed*
dataset, and the job's own ``ml/`` code (as a deterministic tar) when it ships one. Same data and
params, same job, however packed.

A job hash is a sha256 in lowercase hex, 64 digits, like the content hashes that name a job's
dataset and code objects; it names a directory, a NATS subject token and a KV key, and holds
nothing that could be a separator or a path. Users may name a job by a unique prefix of its hash
(or ``latest``, as ScalarLM allows): a reference, resolved by the trainer, not a hash.

Standard library and pydantic only: the training program imports it inside a Slurm job.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import StringConstraints

SHA256_HEX_PATTERN = r"^[0-9a-f]{64}$"
_SHA256_HEX = re.compile(SHA256_HEX_PATTERN)

# A field that holds a sha256 hex digest: job hashes, dataset and code object names.
Sha256Hex = Annotated[str, StringConstraints(pattern=SHA256_HEX_PATTERN)]
JobHash = Sha256Hex


def is_job_hash(text: object) -> bool:
    """A whole job hash (not a prefix, not ``latest``): safe as a directory name and subject token."""
    return isinstance(text, str) and _SHA256_HEX.match(text) is not None


def canonical_json(params: Mapping[str, Any]) -> bytes:
    """Sorted-keys compact JSON: equal dicts give equal bytes, whatever the key order. NaN and
    infinity are refused (ValueError): they are not JSON."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def job_hash(params: Mapping[str, Any], dataset_sha256: str, code_sha256: str | None = None,
             owner: str | None = None) -> str:
    """The hash naming the job; ``params`` are the canonical params (``train_params.canonical``).
    The parts are hashed as one canonical JSON object, so no two different (params, dataset, code)
    can run together into the same bytes. ``owner`` (the submitting API key's name, when keys are
    on) is part of it: two tenants submitting the same content get a job each, rather than one
    reading the other's (gateway/auth/tenancy.py); without keys the hash is what it always was."""
    whole: dict[str, Any] = {"params": params, "dataset_sha256": dataset_sha256, "code_sha256": code_sha256}
    if owner is not None:
        whole["owner"] = owner
    return hashlib.sha256(canonical_json(whole)).hexdigest()

"""Statuses and request bodies the ScalarLM routes share (their declarations: core/route_spec.py)."""

from __future__ import annotations

from typing import Any

JOB = {404: "no such job", 422: "the job name is ambiguous (a prefix of several jobs) or empty"}
ARCHIVE = {
    400: "the archive cannot be read, holds an unsafe path, or `params` is not JSON",
    403: "the archive ships its own `ml/` code and this trainer does not run user code",
    413: "the archive or its dataset is larger than the limits, or a dataset line is longer than "
         "`LOOPLINE_MAX_DATASET_LINE_BYTES`",
    422: "`params` is not valid train_args (the message names the field), or the dataset is invalid",
}

# Bodies the routes read themselves (so FastAPI cannot describe them).
TRAIN_FORM = {"type": "object", "required": ["file"], "properties": {
    "file": {"type": "string", "format": "binary",
             "description": "tar(.gz) with dataset.jsonlines and optionally ml/"},
    "params": {"type": "string", "description": "train_args as a JSON object"}}}
TRAIN_BODY: dict[str, Any] = {
    "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": TRAIN_FORM}}}}
CHUNK_BODY: dict[str, Any] = {
    "parameters": [{"name": name, "in": "header", "required": True, "schema": {"type": "string"},
                    "description": why}
                   for name, why in (("X-Upload-Id", "what init answered"),
                                     ("X-Chunk-Index", "the chunk's position, from 0"),
                                     ("X-Chunk-Hash", "the chunk's sha256, in hex"))],
    "requestBody": {"required": True, "content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}}}}}

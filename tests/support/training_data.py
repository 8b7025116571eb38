"""Training datasets and archives for tests, packed the way ScalarLM's client packs them."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile

EXAMPLES = [{"input": "What is i + i?", "output": "The answer is 2i."},
            {"input": "What is 2 + 2?", "output": "4"}]


def jsonlines(examples: list[dict]) -> bytes:
    # What the client's jsonlines writer produces: one compact-ish JSON object per line.
    return "".join(json.dumps(e) + "\n" for e in examples).encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def archive(files: dict[str, bytes], *, mtime: int = 0) -> bytes:
    """A tar.gz of ``files``; ``mtime`` lands in the gzip header, as with the 1.151 SDK."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return gzip.compress(raw.getvalue(), mtime=mtime)

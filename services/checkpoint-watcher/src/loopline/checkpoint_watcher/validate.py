"""Is a checkpoint fit to serve? Checks of its two adapter files, without torch or numpy.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON naming each
tensor's dtype, shape and byte range in the data that follows, then the data. We read only the
header and the file size: that is enough to catch a truncated or malformed file (the ranges must
tile the data exactly, as the reference reader demands), without reading gigabytes of weights.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, BinaryIO

from loopline.common.contracts.adapter_format import adapter_type_of

# The reference reader refuses headers above 100 MB; ours are a few KB.
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_CONFIG_BYTES = 1024 * 1024
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
_TOKENFORMER_NAME = re.compile(r"^(.+)\.tokenformer_([kv])$")


class Rejected(Exception):
    """The checkpoint is corrupt or not servable; the message says why."""


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte range in the data section
    end: int


def adapter_config(raw: bytes, step: int) -> dict[str, Any]:
    """The parsed adapter_config.json; ``adapter_type`` is always set in the result."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise Rejected(f"adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Rejected(f"adapter_config.json is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise Rejected("adapter_config.json is not a JSON object")
    kind = adapter_type_of(config)
    if kind is None:
        raise Rejected(f"adapter_config.json: unknown adapter_type {config.get('adapter_type')!r}")
    # A folder whose config names another step was copied or renamed by hand: not what it claims.
    if "step" in config and config["step"] != step:
        raise Rejected(f"adapter_config.json says step {config['step']!r}, the folder says {step}")
    if kind == "tokenformer":
        n = config.get("num_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise Rejected(f"tokenformer adapter_config.json: bad num_tokens {n!r}")
    return {**config, "adapter_type": kind}


def safetensors_header(f: BinaryIO, size: int) -> list[Tensor]:
    """The tensors of an open safetensors file of ``size`` bytes, checked against that size."""
    if size < 8:
        raise Rejected(f"adapter_model.safetensors has {size} bytes, not even a header length")
    n = int.from_bytes(_pread(f, 8, 0), "little")
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise Rejected(f"adapter_model.safetensors: header of {n} bytes does not fit a {size}-byte file")
    try:
        header = json.loads(_pread(f, n, 8))
    except (ValueError, UnicodeDecodeError) as exc:
        raise Rejected(f"adapter_model.safetensors: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise Rejected("adapter_model.safetensors: header is not a JSON object")
    tensors = [_tensor(name, entry) for name, entry in header.items() if name != "__metadata__"]
    if not tensors:
        raise Rejected("adapter_model.safetensors holds no tensors")
    # The ranges must tile the data section: no gap, no overlap, nothing missing at the end.
    data_bytes = size - 8 - n
    offset = 0
    for t in sorted(tensors, key=lambda t: (t.start, t.end)):
        if t.start != offset:
            raise Rejected(f"adapter_model.safetensors: tensor {t.name!r} starts at {t.start}, "
                           f"expected {offset} (overlapping or missing data)")
        offset = t.end
    if offset != data_bytes:
        what = "is truncated" if offset > data_bytes else "has trailing bytes"
        raise Rejected(f"adapter_model.safetensors {what}: tensors need {offset} data bytes, "
                       f"the file has {data_bytes}")
    return tensors


def tensors_match(config: dict[str, Any], tensors: list[Tensor]) -> None:
    """The tensors are those the adapter type needs (names and shapes of docs/adapter-format.md)."""
    kind = config["adapter_type"]
    if kind == "tokenformer":
        pairs: dict[str, dict[str, Tensor]] = {}
        for t in tensors:
            m = _TOKENFORMER_NAME.match(t.name)
            if not m:
                raise Rejected(f"tokenformer checkpoint holds a tensor {t.name!r} that is no K or V")
            pairs.setdefault(m.group(1), {})[m.group(2)] = t
        for module, kv in pairs.items():
            missing = {"k", "v"} - set(kv)
            if missing:
                raise Rejected(f"tokenformer module {module!r} has no tokenformer_{missing.pop()} tensor")
            for t in kv.values():
                if len(t.shape) != 2 or t.shape[0] != config["num_tokens"]:
                    raise Rejected(f"tokenformer tensor {t.name!r} has shape {list(t.shape)}, "
                                   f"expected [{config['num_tokens']}, d]")
    elif kind == "lora" and not any(".lora_" in t.name for t in tensors):
        raise Rejected("lora checkpoint holds no lora_* tensor")
    # "none" (full weights): any names; the inference side matches them against its model.


def _tensor(name: str, entry: Any) -> Tensor:
    if not isinstance(entry, dict):
        raise Rejected(f"adapter_model.safetensors: entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise Rejected(f"adapter_model.safetensors: tensor {name!r} has unknown dtype {dtype!r}")
    if not (isinstance(shape, list) and all(_natural(d) for d in shape)):
        raise Rejected(f"adapter_model.safetensors: tensor {name!r} has a bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise Rejected(f"adapter_model.safetensors: tensor {name!r} has bad data_offsets {offsets!r}")
    start, end = offsets
    if end - start != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise Rejected(f"adapter_model.safetensors: tensor {name!r} ({dtype} {shape}) "
                       f"spans {end - start} bytes")
    return Tensor(name, dtype, tuple(shape), start, end)


def _natural(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _pread(f: BinaryIO, n: int, offset: int) -> bytes:
    data = os.pread(f.fileno(), n, offset)
    if len(data) != n:
        raise Rejected(f"adapter_model.safetensors: short read at {offset} (file changed while read)")
    return data

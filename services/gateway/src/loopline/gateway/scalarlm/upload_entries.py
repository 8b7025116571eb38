"""Reading ``/v1/generate/upload``'s file as a stream: a JSON array of requests, one entry at a time.

The file may be as large as ``LOOPLINE_MAX_UPLOAD_BYTES`` (1 GiB). Parsed whole (``json.loads``) it
cost several times that in Python objects before admission could say no; here no more than one
entry (at most ``LOOPLINE_MAX_BODY_BYTES``, the limit of a whole ``/v1/generate``) and one block of
the file are held at a time. The caller spools what it keeps of each entry to disk.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Iterator
from typing import IO, Any

BLOCK = 1024 * 1024
_WHITESPACE = " \t\n\r"
_DECODER = json.JSONDecoder()
_LONGEST_CUT = 8


class NotAnArray(ValueError):
    """The file is not a JSON array (or is cut short); the message says where."""


class EntryTooLarge(ValueError):
    """One entry is longer than allowed; raised before more of it is read."""

    def __init__(self, index: int, limit: int):
        super().__init__(f"request {index} is longer than {limit} bytes")
        self.index, self.limit = index, limit


def file_sha256(f: IO[bytes]) -> str:
    """The file's sha256, read block by block (the upload's id: equal files are one batch)."""
    f.seek(0)
    sha = hashlib.sha256()
    while block := f.read(BLOCK):
        sha.update(block)
    f.seek(0)
    return sha.hexdigest()


class _Text:
    """The file as UTF-8 text, read a block at a time into a buffer the parser consumes."""

    def __init__(self, f: IO[bytes]):
        self.f = f
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.eof = False

    def more(self) -> bool:
        """Append the next block; False at the end of the file."""
        if self.eof:
            return False
        block = self.f.read(BLOCK)
        try:
            text = self.decoder.decode(block, final=not block)
        except UnicodeDecodeError as exc:
            raise NotAnArray(f"the file is not UTF-8 text: {exc.reason}") from None
        self.eof = not block
        # What was consumed is dropped, so the buffer holds at most an entry and a block.
        self.buf = self.buf[self.pos:] + text
        self.pos = 0
        return True

    def next_char(self) -> str | None:
        """The next character that is not whitespace (not consumed); None at the end."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return None


def entries(f: IO[bytes], max_entry_bytes: int) -> Iterator[Any]:
    """The array's entries in order, each parsed as it is reached. Raises NotAnArray for anything
    but one JSON array (trailing whitespace allowed), EntryTooLarge for an entry beyond the limit."""
    f.seek(0)
    text = _Text(f)
    if text.next_char() != "[":
        raise NotAnArray("the uploaded file must be a JSON array of requests")
    text.pos += 1
    index = 0
    if text.next_char() == "]":
        text.pos += 1
    else:
        while True:
            if text.next_char() is None:
                raise NotAnArray(f"the file ends inside the array, before request {index}")
            yield _entry(text, index, max_entry_bytes)
            index += 1
            after = text.next_char()
            text.pos += 1
            if after == "]":
                break
            if after != ",":
                raise NotAnArray(f"the uploaded file is not valid JSON: expected ',' or ']' after request "
                                 f"{index - 1}, found {after!r}")
    if text.next_char() is not None:
        raise NotAnArray("the uploaded file is not valid JSON: extra data after the array")


def _entry(text: _Text, index: int, limit: int) -> Any:
    """One entry from the buffer, reading more while it is incomplete (a value cut by a block's end
    fails to decode, or is a number that may go on) and the limit allows."""
    while True:
        try:
            value, end = _DECODER.raw_decode(text.buf, text.pos)
        except json.JSONDecodeError as exc:
            # Cut short by the buffer's end (a string runs on, or the error is at the very end: a
            # literal such as ``tru`` is the longest cut that fails a few characters back), or wrong.
            cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(text.buf) - _LONGEST_CUT
            if cut and len(text.buf) - text.pos > limit:
                raise EntryTooLarge(index, limit) from None
            if not cut or not text.more():
                raise NotAnArray(f"the uploaded file is not valid JSON: request {index}: {exc.msg}") from None
            continue
        # Characters, not bytes: a rough bound is enough to keep one entry from holding the memory.
        if end - text.pos > limit:
            raise EntryTooLarge(index, limit)
        if end > len(text.buf) - _LONGEST_CUT and text.more():
            continue  # a number near the buffer's end ("12" of "12.5e3") may go on in the next block
        text.pos = end
        return value

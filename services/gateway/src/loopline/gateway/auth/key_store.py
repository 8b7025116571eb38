"""API keys as the gateway knows them: the keys file (``LOOPLINE_API_KEYS_FILE``, written by
``loopline keys``) and the plain ``LOOPLINE_API_KEYS``, looked up by the key's SHA-256.

The file holds no key, only its SHA-256 in hex. A key is 256 random bits (``new_key``), so an
unsalted hash cannot be reversed by guessing, and a lookup stays one dict access; a slow salted hash
(scrypt) would cost each request tens of milliseconds and buy nothing against keys nobody can guess.

The file, one JSON object::

    {"keys": [{"name": "alice", "sha256": "<64 hex>", "scopes": ["inference"],
               "requests_per_minute": 600, "burst": 20, "max_in_flight": 8, "created_at": 1.7e9}]}

The limits are optional (absent: unlimited). ``KeyStore`` re-reads the file when it changes, looked
at no more than once a second, so keys are added and revoked without a restart; writers replace it
whole (``write_key_file``), so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loopline.common.atomic_files import write_atomic
from loopline.common.contracts.job_hash import Sha256Hex
from loopline.gateway.auth.scopes import ADMIN, SCOPES

log = logging.getLogger(__name__)

# The tinker SDK refuses keys that do not start with it; one prefix lets a key serve every client.
KEY_PREFIX = "tml-"
RECHECK_S = 1.0  # how stale the keys may be: the file's mtime is looked at no more often
ScopeName = Literal["inference", "training", "admin"]  # scopes.SCOPES


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
    sha256: Sha256Hex
    scopes: list[ScopeName] = Field(min_length=1)
    requests_per_minute: float | None = Field(default=None, gt=0)
    burst: int | None = Field(default=None, ge=1)
    max_in_flight: int | None = Field(default=None, ge=1)
    created_at: float = 0.0


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry] = Field(default_factory=list)


class KeyFileError(Exception):
    """The keys file cannot be read, or is not a keys file (the message says where)."""


@dataclass(frozen=True)
class ApiKey:
    """A key as a request carries it through the gateway (``api_keys.api_key_of``)."""

    name: str
    scopes: frozenset[str]
    requests_per_minute: float | None = None
    burst: int | None = None
    max_in_flight: int | None = None

    @property
    def is_admin(self) -> bool:
        return ADMIN in self.scopes


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)  # 256 bits


def key_hash(key: str | bytes) -> str:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def read_key_file(path: Path) -> KeyFile:
    """The file's keys; an absent file has none. Raises KeyFileError naming what is wrong."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return KeyFile()
    except OSError as exc:
        raise KeyFileError(f"{path}: {exc}") from exc
    try:
        parsed = KeyFile.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "file"
        raise KeyFileError(f"{path}: {where}: {first['msg']}") from None
    names = [entry.name for entry in parsed.keys]
    if len(set(names)) != len(names):
        raise KeyFileError(f"{path}: a key name is used twice")
    return parsed


def write_key_file(path: Path, keys: KeyFile) -> None:
    """Replace the file whole (a temporary file renamed over it), readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(keys.model_dump(exclude_none=True), indent=1) + "\n", private=True)


def api_key(entry: KeyEntry) -> ApiKey:
    return ApiKey(entry.name, frozenset(entry.scopes), entry.requests_per_minute, entry.burst,
                  entry.max_in_flight)


class KeyStore:
    """The keys a gateway accepts now, by SHA-256: the plain ones (every scope, no limits) and the
    file's, refreshed when the file changes."""

    def __init__(self, path: Path | None, plain_keys: frozenset[str]):
        self.path = path
        self._plain = {key_hash(key): ApiKey(f"LOOPLINE_API_KEYS#{n}", frozenset(SCOPES))
                       for n, key in enumerate(sorted(plain_keys), 1)}
        self._by_hash = dict(self._plain)
        self._seen: tuple[int, int, int] | None = None  # the file's (mtime_ns, size, inode) read
        self._checked = float("-inf")
        self.refresh(force=True)

    def lookup(self, token: bytes) -> ApiKey | None:
        if time.monotonic() - self._checked >= RECHECK_S:
            self.refresh()
        return self._by_hash.get(key_hash(token))

    def lookup_hash(self, sha256: str) -> ApiKey | None:
        """The key with this SHA-256 while the gateway still has it: a dashboard session's
        (ui_sessions.py), which ends when its key is revoked or rotated."""
        if time.monotonic() - self._checked >= RECHECK_S:
            self.refresh()
        return self._by_hash.get(sha256)

    def refresh(self, force: bool = False) -> None:
        """Read the file again if it changed. A file that cannot be read keeps the keys read last
        (a bad edit does not lock everyone out); an absent file has no keys (all revoked)."""
        self._checked = time.monotonic()
        if self.path is None:
            return
        try:
            st = self.path.stat()
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            seen = (0, 0, 0)
        if seen == self._seen and not force:
            return
        try:
            keys = read_key_file(self.path)
        except KeyFileError as exc:
            log.error("API keys file not (re)loaded, keeping the %d keys read before: %s",
                      len(self._by_hash), exc)
            self._seen = seen
            return
        self._by_hash = {**{entry.sha256: api_key(entry) for entry in keys.keys}, **self._plain}
        self._seen = seen
        log.info("API keys: %d from %s, %d from LOOPLINE_API_KEYS", len(keys.keys), self.path,
                 len(self._plain))

"""Is a job's shipped ``ml/`` Loopline's own? The ``scalarlm`` client ships the ``ml/`` folder of the
directory it runs in, so a user working in a Loopline checkout ships ``ml/src/loopline/ml``: the
very code the trainer runs anyway. That is not user code: such a job is accepted with user code
off, and runs the installed ``loopline.ml`` (the shipped copy is not unpacked, so nothing else in
the archive can run either).

Compared by content: every file of the installed package (bytecode caches aside) must be in the
archive under one prefix with the same bytes, and the archive may hold no other file there.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import tarfile
from pathlib import Path, PurePosixPath

from loopline.common.contracts.job_layout import CODE_DIR

# Where a package's files sit inside a shipped ml/: a checkout's layout (ml/src/loopline/ml, as
# Loopline's own repository has it) or the package at the top (ml/loopline/ml).
PACKAGE_PREFIXES = (f"{CODE_DIR}/src/loopline/ml/", f"{CODE_DIR}/loopline/ml/")


def _counts(rel: str) -> bool:
    """Part of the package's code: not a bytecode cache (the client ships whatever is there)."""
    parts = PurePosixPath(rel).parts
    return "__pycache__" not in parts and not rel.endswith((".pyc", ".pyo"))


def _digest(files: dict[str, str]) -> str:
    """One hash over (relative path, content hash) pairs, in path order."""
    whole = hashlib.sha256()
    for rel in sorted(files):
        whole.update(f"{rel}\0{files[rel]}\n".encode())
    return whole.hexdigest()


@functools.cache
def installed_digest() -> str | None:
    """The digest of the ``loopline.ml`` this trainer's jobs run, None where it is not installed."""
    spec = importlib.util.find_spec("loopline.ml")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    files = {path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
             for path in root.rglob("*") if path.is_file()}
    return _digest({rel: sha for rel, sha in files.items() if _counts(rel)})


def is_installed_ml(tar_path: Path) -> bool:
    """True when the code archive's package is byte for byte the installed ``loopline.ml``."""
    wanted = installed_digest()
    if wanted is None:
        return False
    found: dict[str, dict[str, str]] = {prefix: {} for prefix in PACKAGE_PREFIXES}
    try:
        with tarfile.open(tar_path, mode="r:") as tar:
            # Invariant: found[p] holds every regular file seen so far under prefix p.
            for member in tar:
                prefix = next((p for p in PACKAGE_PREFIXES if member.name.startswith(p)), None)
                if prefix is None or not member.isreg():
                    continue
                rel = member.name[len(prefix):]
                contents = tar.extractfile(member)
                if _counts(rel) and contents is not None:
                    found[prefix][rel] = hashlib.sha256(contents.read()).hexdigest()
    except (tarfile.TarError, OSError):
        return False  # unreadable: extract_code says why, as for any other code archive
    return any(files and _digest(files) == wanted for files in found.values())

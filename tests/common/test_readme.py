"""The README says what the code does: its configuration table is the settings classes' own (generated
by loopline.common.config.settings_doc), its subjects table names exactly the streams, buckets and object
stores of subjects.py with the subjects its functions build, and the docs name no file that is not in
the repository."""

from __future__ import annotations

import difflib
import inspect
import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from loopline.common.config import settings, settings_doc
from loopline.common.contracts import subjects

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
        ROOT / "deploy" / "README.md"]
SUBJECTS_START = "<!-- subjects-table:start"
SUBJECTS_END = "<!-- subjects-table:end -->"
# nats.micro's own discovery subjects: every service answers them, subjects.py does not spell them.
NATS_MICRO = {"$SRV.*"}
# A stream whose subjects have no ``X_ALL`` constant: what it captures instead.
STORED = {subjects.ADVISORIES_STREAM: subjects.max_deliveries_advisory()}
# What a subject function's parameters stand for in the table.
PLACEHOLDER = "<{}>"


def _between(text: str, start: str, end: str) -> str:
    assert start in text and end in text, f"README.md lacks the markers {start!r} … {end!r}"
    return text.split(start, 1)[1].split("\n", 1)[1].split(end, 1)[0]


def test_configuration_table_is_generated_from_the_settings():
    readme = README.read_text()
    expected = settings_doc.readme_with_table(readme)
    if readme != expected:
        diff = "\n".join(difflib.unified_diff(readme.splitlines(), expected.splitlines(),
                                              "README.md", "generated", lineterm="", n=0))
        pytest.fail("README.md's configuration table differs from the settings classes; regenerate it "
                    f"with `make docs` (python -m loopline.common.config.settings_doc --write):\n{diff}")


def test_every_settings_class_is_in_the_table_and_every_field_described():
    classes = {obj for obj in vars(settings).values()
               if inspect.isclass(obj) and issubclass(obj, BaseSettings)
               and obj.__module__ == settings.__name__}
    # CommonSettings is no service: its fields reach the table through every class that inherits them.
    assert classes - {settings.CommonSettings} == set(settings_doc.SERVICES.values()), \
        "a settings class is missing from loopline.common.config.settings_doc.SERVICES"
    for cls in classes:
        undocumented = [name for name, field in cls.model_fields.items() if not field.description]
        assert not undocumented, f"{cls.__name__}: give {undocumented} a Field(description=...)"
    names = [row[0] for row in settings_doc.rows()]
    assert len(names) == len(set(names)), "one row per environment variable"
    assert "`LOOPLINE_MODELS_DIR`" in names and "`LOOPLINE_JOBS_DIR`" in names, "aliases are shown"


def test_table_defaults_are_readable():
    shown = {name.strip("`"): default for name, default, _, _ in settings_doc.rows()}
    assert shown["LOOPLINE_MAX_BODY_BYTES"] == "16 MiB"
    assert shown["LOOPLINE_MAX_UPLOAD_BYTES"] == "1 GiB"
    assert shown["LOOPLINE_MODELS_DIR"] == "`$LOOPLINE_STATE_DIR/models`"
    assert shown["LOOPLINE_API_KEYS"] == "unset"
    assert shown["LOOPLINE_ADAPTERS"] == "`true`"
    assert shown["LOOPLINE_UPLOAD_TTL_S"] == "`21600` (6 h)"


# --- the subjects table ----------------------------------------------------------------------------
def _subjects_rows() -> list[list[str]]:
    body = _between(README.read_text(), SUBJECTS_START, SUBJECTS_END)
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in body.splitlines() if line.startswith("|")]
    assert rows[0][:3] == ["name", "kind", "subjects or keys"], rows[0]
    return rows[2:]


def _code(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _constants(suffix: str) -> dict[str, str]:
    return {name: value for name, value in vars(subjects).items()
            if name.endswith(suffix) and isinstance(value, str)}


def _defined_subjects(monkeypatch) -> set[str]:
    """Every subject subjects.py spells: its constants, and what each function builds with its
    parameters as ``<name>`` placeholders (deployment keys left as the placeholder they are given)."""
    monkeypatch.setattr(subjects, "deployment_key", lambda model_name: model_name)
    found = {value for name, value in vars(subjects).items()
             if name.isupper() and isinstance(value, str)
             and not name.endswith(("_STREAM", "_BUCKET", "_DURABLE", "_SERVICE"))}
    for function in vars(subjects).values():
        if inspect.isfunction(function) and function.__module__ == subjects.__name__:
            required = [p.name for p in inspect.signature(function).parameters.values()
                        if p.default is inspect.Parameter.empty]
            found.add(function(*[PLACEHOLDER.format(p) for p in required]))
    return found


def _nats_match(pattern: str, subject: str) -> bool:
    """Whether NATS delivers ``subject`` to a subscription on ``pattern`` (``*``: one token, ``>``:
    the rest)."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def test_subjects_table_names_every_stream_bucket_and_object_store():
    stores = {row[0] for row in _subjects_rows() if row[0].startswith("`")}
    in_table = {name.strip("`") for name in stores}
    streams = set(_constants("_STREAM").values())
    buckets = set(_constants("_BUCKET").values())
    missing = (streams | buckets) - in_table
    assert not missing, f"README's subjects table lacks {sorted(missing)}"
    assert in_table <= streams | buckets, f"README names {sorted(in_table - streams - buckets)}, " \
                                          "which subjects.py does not define"
    for row in _subjects_rows():
        name, kind = row[0].strip("`"), row[1]
        if name in streams:
            assert kind.startswith("stream"), f"{name} is a stream, the README says {kind!r}"
        elif name in buckets:
            assert kind.startswith(("KV", "object store")), f"{name} is a bucket, the README says {kind!r}"
        else:
            assert name == "core", f"a row names {name!r}: a stream, a bucket, or core"


def test_subjects_table_subjects_are_the_ones_subjects_py_builds(monkeypatch):
    defined = _defined_subjects(monkeypatch)
    streams = {value: name.removesuffix("_STREAM") for name, value in _constants("_STREAM").items()}
    for row in _subjects_rows():
        name, kind, patterns = row[0].strip("`"), row[1], _code(row[2])
        assert patterns, f"row {name}: no subjects or keys"
        if kind.startswith(("KV", "object store")):
            continue  # keys and object names, not subjects
        for pattern in patterns:
            known = pattern in defined or pattern in NATS_MICRO or (
                any(ch in pattern for ch in "*>") and any(_nats_match(pattern, s) for s in defined))
            assert known, f"README's subjects table names {pattern!r}, which subjects.py does not build"
            if name in streams:
                # The row's subjects are what its stream stores (X_ALL, or the advisory it captures).
                captured = STORED.get(name) or getattr(subjects, f"{streams[name]}_ALL")
                concrete = re.sub(r"<[^>]+>", "x", pattern)
                assert _nats_match(captured, concrete), f"{pattern!r} is not stored in {name} ({captured})"


def test_subjects_table_names_every_request_reply_subject():
    patterns = [p for row in _subjects_rows() for p in _code(row[2])]
    for name, subject in _constants("").items():
        if name.startswith("SVC_"):
            assert any(_nats_match(p, subject) for p in patterns), \
                f"README's subjects table does not name {subject} ({name})"


# --- no file outside the repository -------------------------------------------------------------
def _markdown_files(folder: Path) -> list[Path]:
    """The repository's markdown files, not those of hidden folders (.venv, .loopline, .git)."""
    found = list(folder.glob("*.md"))
    for sub in folder.iterdir():
        if sub.is_dir() and not sub.name.startswith((".", "__")) and sub.name != "node_modules":
            found += _markdown_files(sub)
    return found


# A path that starts at one of the repository's top folders, e.g. services/gateway/src/….
TOP_FOLDERS = "services|libs|ml|cli|deploy|docs|bench|tests|scripts"
REPO_PATH = re.compile(rf"(?<![\w./-])((?:{TOP_FOLDERS})/[\w./-]*[\w/])")
# Written by the benchmarks, git-ignored.
GENERATED = ("bench/results/",)


def _in_repository(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT) and path.exists()


def test_docs_name_only_files_in_the_repository():
    tracked = [str(path.relative_to(ROOT)) for path in _markdown_files(ROOT)]
    for doc in DOCS:
        text, where = doc.read_text(), doc.relative_to(ROOT)
        for target in re.findall(r"\]\(([^)\s#]+)", text):
            if "://" not in target:
                assert _in_repository(doc.parent / target), f"{where} links to {target}, not a file here"
        for name in set(re.findall(r"[\w./-]*\w\.md\b", text)):
            found = _in_repository(ROOT / name) or _in_repository(doc.parent / name) or (
                not name.startswith("../") and any(path.endswith(name) for path in tracked))
            assert found, f"{where} names {name}, which is not in the repository"
        for path in set(re.findall(REPO_PATH, text)):
            assert path.startswith(GENERATED) or (ROOT / path).exists(), \
                f"{where} names {path}, which is not in the repository"


FAMILIES_START = "<!-- families-table:start"
FAMILIES_END = "<!-- families-table:end -->"


def test_the_supported_models_table_is_the_one_the_family_tests_hold():
    from loopline.ml.models.families import FAMILIES
    from support.family_support import SUPPORT, table

    assert _between(README.read_text(), FAMILIES_START, FAMILIES_END) == table(), \
        "README.md's supported-models table differs from tests/support/family_support.py's table()"
    assert set(SUPPORT) == {"tiny", "tiny-embed", *FAMILIES}, "a row per family's tiny model"

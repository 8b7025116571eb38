"""The one way Loopline replaces a file or a folder whole (loopline.common.atomic_files)."""

from __future__ import annotations

import os
import stat

import pytest

from loopline.common.atomic_files import atomic_dir, replace_dir, write_atomic


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "record.json"
    write_atomic(path, "old\n")
    write_atomic(path, b"new\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert _mode(path) == 0o666 & ~umask  # what open() gives a new file: others may read it


def test_write_atomic_private_is_owner_only(tmp_path):
    path = tmp_path / "keys.json"
    write_atomic(path, "secret", private=True)
    assert _mode(path) == 0o600


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "settings.json"
    write_atomic(path, "old")
    with pytest.raises(TypeError):
        write_atomic(path, 42)  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["settings.json"]


def test_atomic_dir_replaces_a_folder_whole(tmp_path):
    final = tmp_path / "folder-1"
    with atomic_dir(final) as temp:
        assert temp.parent == tmp_path and temp.name.startswith(".tmp-folder-1-")
        (temp / "a").write_text("1")
    assert _mode(final) == 0o755
    with atomic_dir(final, mode=None) as temp:
        (temp / "b").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["b"] and _mode(final) == 0o700
    assert [p.name for p in tmp_path.iterdir()] == ["folder-1"]


def test_a_failed_atomic_dir_leaves_the_old_folder(tmp_path):
    final = tmp_path / "adapter"
    with atomic_dir(final) as temp:
        (temp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(final) as temp:
        (temp / "half").write_text("x")
        raise RuntimeError("out of disk")
    assert [p.name for p in final.iterdir()] == ["a"]
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_replace_dir_moves_a_finished_folder_over_an_old_one(tmp_path):
    old, new = tmp_path / "job", tmp_path / ".staging-job"
    old.mkdir()
    (old / "stale").write_text("")
    new.mkdir()
    (new / "settings.json").write_text("{}")
    replace_dir(new, old)
    assert [p.name for p in old.iterdir()] == ["settings.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["job"]

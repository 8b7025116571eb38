"""The adapter files' one writer: both files as readable as the umask allows, since the
checkpoint-watcher reads them as another user (a job running as a uid of its own)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from loopline.common.contracts.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from loopline.ml.adapters.io import read_tensors, write_adapter


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_both_adapter_files_get_the_umask_s_mode(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_adapter(tmp_path, {"adapter_type": "lora"}, {"w": torch.ones(2, 2)})
    finally:
        os.umask(old)
    # safetensors alone makes its file 0600, which the watcher's group could not read.
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert torch.equal(read_tensors(tmp_path)["w"], torch.ones(2, 2))

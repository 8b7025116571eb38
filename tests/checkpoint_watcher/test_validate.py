"""The watcher's checks and packing, without processes: safetensors headers written by the real
``safetensors`` library (and broken by hand), adapter configs, the deterministic tar, and which
inotify paths wake a job."""

from __future__ import annotations

import json
import struct

import pytest

from loopline.checkpoint_watcher import pack, validate, watch
from loopline.checkpoint_watcher.validate import Rejected
from loopline.common.contracts.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from loopline.common.contracts.job_layout import (
    CHECKPOINTS_DIR,
    STATUS_FILE,
    TRAINING_STATE_FILE,
    checkpoint_name,
    checkpoint_temp_prefix,
)


@pytest.fixture
def weights(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"m.tokenformer_k": torch.ones(4, 3),
               "m.tokenformer_v": torch.zeros(4, 5, dtype=torch.bfloat16)}, str(path))
    return path


def header(path) -> list[validate.Tensor]:
    with open(path, "rb") as f:
        return validate.safetensors_header(f, path.stat().st_size)


def rewrite_header(path, change) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    change(head)
    new = json.dumps(head).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_a_real_file_parses(weights):
    tensors = {t.name: t for t in header(weights)}
    assert tensors["m.tokenformer_k"].shape == (4, 3) and tensors["m.tokenformer_k"].dtype == "F32"
    assert tensors["m.tokenformer_v"].end - tensors["m.tokenformer_v"].start == 4 * 5 * 2


@pytest.mark.parametrize("change, reason", [
    (lambda h: h["m.tokenformer_k"].update(dtype="F7"), "unknown dtype"),
    (lambda h: h["m.tokenformer_k"].update(shape=[4, -3]), "bad shape"),
    (lambda h: h["m.tokenformer_k"].update(shape=[4, 4]), "spans"),
    (lambda h: h["m.tokenformer_k"].update(data_offsets=[0, "48"]), "bad data_offsets"),
    (lambda h: h.pop("m.tokenformer_v"), "trailing bytes"),
    (lambda h: h.clear(), "no tensors"),
])
def test_a_malformed_header_is_rejected(weights, change, reason):
    rewrite_header(weights, change)
    with pytest.raises(Rejected, match=reason):
        header(weights)


def test_overlapping_ranges_are_rejected(weights):
    def overlap(h):
        k, v = h["m.tokenformer_k"], h["m.tokenformer_v"]
        first, second = (k, v) if k["data_offsets"][0] == 0 else (v, k)
        size = second["data_offsets"][1] - second["data_offsets"][0]
        second["data_offsets"] = [first["data_offsets"][1] - 2, first["data_offsets"][1] - 2 + size]
    rewrite_header(weights, overlap)
    with pytest.raises(Rejected, match=r"overlapping|truncated|trailing"):
        header(weights)


def test_configs():
    raw = json.dumps({"adapter_type": "tokenformer", "num_tokens": 4, "step": 3}).encode()
    ok = validate.adapter_config(raw, 3)
    assert ok["adapter_type"] == "tokenformer"
    assert validate.adapter_config(b'{"peft_type": "LORA", "r": 8}', 1)["adapter_type"] == "lora"
    assert validate.adapter_config(b'{"adapter_type": "none"}', 1)["adapter_type"] == "none"
    for raw, reason in [(b"[]", "not a JSON object"), (b'{"adapter_type": "x"}', "unknown adapter_type"),
                        (b'{"adapter_type": "tokenformer", "num_tokens": 0}', "num_tokens"),
                        (b'{"adapter_type": "none", "step": 2}', "says step 2")]:
        with pytest.raises(Rejected, match=reason):
            validate.adapter_config(raw, 1)


def test_tensors_must_fit_the_adapter_type(weights):
    tensors = header(weights)
    validate.tensors_match({"adapter_type": "tokenformer", "num_tokens": 4}, tensors)
    with pytest.raises(Rejected, match="shape"):
        validate.tensors_match({"adapter_type": "tokenformer", "num_tokens": 8}, tensors)
    with pytest.raises(Rejected, match="no tokenformer_v"):
        validate.tensors_match({"adapter_type": "tokenformer", "num_tokens": 4}, tensors[:1])
    with pytest.raises(Rejected, match="no lora"):
        validate.tensors_match({"adapter_type": "lora"}, tensors)
    validate.tensors_match({"adapter_type": "none"}, tensors)


def test_packing_is_deterministic_and_capped(tmp_path, weights):
    step = tmp_path / checkpoint_name(7)
    step.mkdir()
    (step / CONFIG_FILE).write_text('{"adapter_type": "tokenformer", "num_tokens": 4}')
    weights.rename(step / WEIGHTS_FILE)
    (step / TRAINING_STATE_FILE).write_bytes(b"not stored")
    a = pack.pack(step, 7, 1 << 20)
    (step / CONFIG_FILE).touch()  # a new mtime changes nothing stored
    b = pack.pack(step, 7, 1 << 20)
    assert (a.sha256, a.size, a.data.read()) == (b.sha256, b.size, b.data.read())
    with pytest.raises(Rejected, match="more than the 100 allowed"):
        pack.pack(step, 7, 100)
    with pytest.raises(pack.Vanished):
        pack.pack(tmp_path / checkpoint_name(8), 8, 1 << 20)


def test_only_checkpoint_paths_wake_a_job():
    job = "ab" * 32
    root, checkpoints = "/jobs", f"/jobs/{job}/{CHECKPOINTS_DIR}"
    assert watch.job_of(root, f"/jobs/{job}") == job
    assert watch.job_of(root, checkpoints) == job
    assert watch.job_of(root, f"{checkpoints}/{checkpoint_name(10)}") == job
    for path in (f"/jobs/{job}/{STATUS_FILE}", f"{checkpoints}/{checkpoint_temp_prefix(10)}x",
                 f"{checkpoints}/{checkpoint_temp_prefix(10)}x/{WEIGHTS_FILE}",
                 f"{checkpoints}/{checkpoint_name(10)}/{CONFIG_FILE}",
                 f"/jobs/.staging-{job}-1234", "/jobs/.local-runs/L1.json", f"/jobsx/{job}", "/jobs/a.b",
                 "/jobs/abc", f"/jobs/{job.upper()}"):  # not job hashes
        assert watch.job_of(root, path) is None, path

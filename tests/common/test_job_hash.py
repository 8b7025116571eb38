"""The job hash (loopline.common.contracts.job_hash): its format, and what it is computed over."""

from __future__ import annotations

import hashlib

import pytest
from pydantic import ValidationError

from loopline.common.contracts.job_hash import canonical_json, is_job_hash, job_hash
from loopline.common.contracts.job_schemas import JobSubmit
from loopline.common.contracts.train_params import TrainParams, canonical


def test_canonical_json_ignores_key_order():
    a = {"max_steps": 10, "lora_config": {"r": 8, "alpha": 32}, "llm_name": "m"}
    b = {"llm_name": "m", "lora_config": {"alpha": 32, "r": 8}, "max_steps": 10}
    assert canonical_json(a) == canonical_json(b) == \
        b'{"llm_name":"m","lora_config":{"alpha":32,"r":8},"max_steps":10}'
    assert job_hash(a, "d" * 64) == job_hash(b, "d" * 64)
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_hash_changes_with_params_dataset_and_code():
    base = job_hash({"max_steps": 10}, "a" * 64)
    assert is_job_hash(base)
    assert job_hash({"max_steps": 11}, "a" * 64) != base
    assert job_hash({"max_steps": 10}, "b" * 64) != base
    assert job_hash({"max_steps": 10}, "a" * 64, "c" * 64) != base


def test_params_that_mean_the_same_job_hash_the_same():
    def hashed(raw: dict) -> str:
        return job_hash(canonical(TrainParams.model_validate(raw)), "a" * 64)

    assert hashed({"seed": None, "lora_config": None}) == hashed({})
    assert hashed({"adapter_type": "LoRA", "lr_decay": "Cosine"}) == hashed({"adapter_type": "lora",
                                                                             "lr_decay": "cosine"})
    assert hashed({"learning_rate": 1}) == hashed({"learning_rate": 1.0})
    # What ScalarLM clients send beyond our params is kept, and is part of the job.
    assert hashed({"gpus": 2}) != hashed({"gpus": 4}) != hashed({})


def test_the_format_is_lowercase_sha256_hex():
    digest = hashlib.sha256(b"x").hexdigest()
    assert is_job_hash(digest)
    for bad in (digest.upper(), digest[:12], digest + "0", "latest", "../../etc", "job-a", None, 5):
        assert not is_job_hash(bad), bad


def test_a_submit_names_the_job_and_its_objects_by_their_hash():
    digest = hashlib.sha256(b"x").hexdigest()
    ok = JobSubmit(job_hash=digest, params={}, dataset_sha256=digest, dataset_bytes=1, examples=1)
    assert ok.code_sha256 is None
    for field in ("job_hash", "dataset_sha256", "code_sha256"):
        with pytest.raises(ValidationError, match=field):
            JobSubmit.model_validate({"job_hash": digest, "params": {}, "dataset_sha256": digest,
                                      "dataset_bytes": 1, "examples": 1, field: "../" + digest[3:]})

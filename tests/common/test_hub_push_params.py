"""push_to_hub in TrainParams (contracts/hub_push.py): the Hub's own name rules at submission, and a
canonical form (the job hash's) that holds what the client set."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loopline.common.contracts.train_params import TrainParams, canonical


def test_what_the_client_set_is_what_names_the_job():
    params = TrainParams.model_validate({"push_to_hub": {"repo_id": "org/My-Model.v2"}})
    assert params.push_to_hub is not None
    assert (params.push_to_hub.private, params.push_to_hub.revision) == (True, "main")
    assert canonical(params) == {"push_to_hub": {"repo_id": "org/My-Model.v2"}}
    assert canonical(TrainParams.model_validate({"push_to_hub": None})) == {}  # null: not asked
    nulls = TrainParams.model_validate(
        {"push_to_hub": {"repo_id": "org/m", "revision": None, "private": None}})
    assert canonical(nulls) == {"push_to_hub": {"repo_id": "org/m"}}


@pytest.mark.parametrize("request_, field, words", [
    ({"repo_id": "org/a b"}, "repo_id", "alphanumeric"),  # huggingface_hub's own message
    ({"repo_id": "org/a--b"}, "repo_id", "--"),
    ({"repo_id": "model"}, "repo_id", "namespace/name"),
    ({"repo_id": "a/b/c"}, "repo_id", "namespace"),
    ({}, "repo_id", "required"),
    ({"repo_id": "org/m", "revision": "0123456789abcdef0123456789abcdef01234567"}, "revision", "commit hash"),
    ({"repo_id": "org/m", "revision": "feature/x"}, "revision", "branch name"),
    ({"repo_id": "org/m", "revision": "x.lock"}, "revision", "branch name"),
    ({"repo_id": "org/m", "private": "yes"}, "private", "boolean"),
    ({"repo_id": "org/m", "token": "hf_secret"}, "token", "not permitted"),  # a job carries no token
])
def test_a_push_the_hub_would_refuse_is_refused_naming_the_field(request_, field, words):
    with pytest.raises(ValidationError) as refused:
        TrainParams.model_validate({"push_to_hub": request_})
    [error] = refused.value.errors()
    assert error["loc"] == ("push_to_hub", field)
    assert words in error["msg"], error["msg"]

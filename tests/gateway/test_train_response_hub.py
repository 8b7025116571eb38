"""A job's push to the Hub (JobInfo.hub, from the trainer) is in the ScalarLM training response that
``get_training_job`` returns, beside the fields ScalarLM's client reads."""

from __future__ import annotations

from loopline.common.contracts.hub_push import HubPush
from loopline.common.contracts.job_schemas import JobInfo, JobStatus
from loopline.common.contracts.train_params import TrainParams
from loopline.gateway.scalarlm.train_models import train_response


def test_the_push_outcome_is_in_the_response():
    params = TrainParams.model_validate({"push_to_hub": {"repo_id": "org/m"}})
    hub = HubPush(repo_id="org/m", revision="main", status="failed", error="HfHubHTTPError: 401")
    info = JobInfo(job_hash="a" * 64, status=JobStatus.COMPLETED, params=params, llm_name="tiny",
                   adapter_type="tokenformer", job_directory="/jobs/a", created_at=1.0, hub=hub)
    body = train_response(info, deployed=True).model_dump(mode="json")
    assert body["hub"] == {"repo_id": "org/m", "revision": "main", "status": "failed", "url": None,
                           "commit": None, "error": "HfHubHTTPError: 401"}
    assert body["job_config"]["push_to_hub"] == {"repo_id": "org/m"}
    assert body["job_status"]["status"] == "COMPLETED"
    assert train_response(info.model_copy(update={"hub": None}), deployed=True).hub is None

"""The trainer's push to the Hub (hub_push.py), on checkpoints the real training program wrote for the
tiny model, against tests/support/fake_hub.py (the real Hub cannot be reached from here): what comes
back through ``snapshot_download`` loads in PEFT and transformers and computes what the checkpoint
computes; the card says where it came from; a refused or unreachable Hub, or a planted link, is a
failed push with the reason, never an exception. The operator's token writes only where the
operator's settings let it: never to an existing repo this trainer did not create for the job's key,
nor a public one unless allowed (what was asked of the Hub is in FakeHub.calls)."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, snapshot_download

from loopline.common.config.settings import TrainerSettings
from loopline.common.contracts import adapter_format
from loopline.common.contracts.job_hash import job_hash
from loopline.common.contracts.job_layout import (
    CHECKPOINTS_DIR,
    DATASET_FILE,
    TRAINING_STATE_FILE,
    checkpoint_name,
)
from loopline.common.contracts.job_schemas import JobStatus
from loopline.common.contracts.train_params import JobConfig, TrainParams, canonical
from loopline.common.db.engine import migrate, open_database
from loopline.ml.adapters import apply_adapter
from loopline.ml.train.checkpoint import latest_checkpoint
from loopline.trainer.hub_folder import MODEL_CONFIG_FILE, MODEL_WEIGHTS_FILE
from loopline.trainer.hub_push import HubPusher
from loopline.trainer.hub_repos import HubRepos
from loopline.trainer.info import job_info
from loopline.trainer.registry import Job
from support.fake_hub import FakeHub
from support.stacks import tiny_model

TOKEN = "hf_test_token"
PAIRS = [("What is 1 + 1?", " The answer is 2."), ("Say hello.", " Hello there!")]
RECIPE = {"max_steps": 3, "learning_rate": 1e-2, "batch_size": 2, "gradient_accumulation_steps": 1}
IDS = torch.tensor([[5, 17, 99, 300, 12]])


@pytest.fixture(scope="module")
def hub():
    with FakeHub(tokens={TOKEN}) as running:
        yield running


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("secret") / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """The trainer's record of the repos it created, in a registry database of its own."""
    engine = open_database(f"sqlite:///{tmp_path_factory.mktemp('registry') / 'loopline.db'}")
    migrate(engine)
    yield HubRepos(engine)
    engine.dispose()


@pytest.fixture
def pusher(hub, token_file, repos):
    def make(token: Path = token_file, endpoint: str | None = None, **settings) -> HubPusher:
        return HubPusher(TrainerSettings(hub_endpoint=endpoint or hub.url, hub_token_file=token,
                                         **settings), repos)
    return make


def aimed(job: Job, repo_id: str, owner: str | None = None, **push) -> Job:
    """The job with its push_to_hub sent to ``repo_id`` (and ``push``'s other fields), as
    submitted by the key named ``owner``."""
    request = job.params.push_to_hub.model_copy(update={"repo_id": repo_id, **push})
    params = job.params.model_copy(update={"push_to_hub": request})
    return type(job)(**{**job.__dict__, "params": params, "owner": owner})


def trained_job(root: Path, name: str, params: dict) -> Job:
    """A job directory trained by the real program (``python -m loopline.ml.train``) on the tiny
    model, and the registry's Job for it, COMPLETED."""
    job_dir = root / name
    job_dir.mkdir(parents=True)
    dataset = "".join(json.dumps({"input": q, "output": a}) + "\n" for q, a in PAIRS).encode()
    (job_dir / DATASET_FILE).write_bytes(dataset)
    checked = TrainParams.model_validate({**params, "llm_name": "tiny"})
    dataset_sha = hashlib.sha256(dataset).hexdigest()
    config = JobConfig(job_hash=job_hash(canonical(checked), dataset_sha), model_path=tiny_model(),
                       params=checked)
    config.write(job_dir)
    run = subprocess.run([sys.executable, "-m", "loopline.ml.train", "--job-dir", str(job_dir)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    now = time.time()
    return Job(job_hash=config.job_hash, status=JobStatus.COMPLETED, params=checked, llm_name="tiny",
               model_path=config.model_path, adapter_type=checked.adapter_type, job_dir=job_dir,
               dataset_sha256=dataset_sha, code_sha256=None, launcher="local", slurm_job_id="1", attempts=1,
               retries=0, step_at_submit=0, created_at=now, submitted_at=now, started_at=now, finished_at=now,
               step=checked.max_steps, max_steps=checked.max_steps, loss=None, error=None, events_seq=0,
               events_offset=0, events_done=True)


@pytest.fixture(scope="module")
def lora_job(tmp_path_factory) -> Job:
    return trained_job(tmp_path_factory.mktemp("jobs"), "lora",
                       {**RECIPE, "adapter_type": "lora", "push_to_hub": {"repo_id": "tester/tiny-lora"}})


@pytest.fixture(scope="module")
def full_job(tmp_path_factory) -> Job:
    return trained_job(tmp_path_factory.mktemp("jobs"), "none",
                       {**RECIPE, "adapter_type": "none",
                        "push_to_hub": {"repo_id": "tester/tiny-full", "private": False}})


def download(hub: FakeHub, repo_id: str, tmp_path: Path, revision: str = "main") -> Path:
    return Path(snapshot_download(repo_id, revision=revision, endpoint=hub.url, token=TOKEN,
                                  cache_dir=tmp_path / "hf-cache"))


def base_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model(), dtype=torch.float32).eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_a_lora_job_is_pushed_as_a_peft_adapter_that_computes_what_the_checkpoint_does(
        hub, pusher, lora_job, tmp_path):
    from peft import PeftModel

    outcome = pusher().push(lora_job)
    assert outcome.status == "pushed", outcome.error
    assert outcome.url == f"{hub.url}/tester/tiny-lora/commit/{outcome.commit}"
    assert hub.repos["tester/tiny-lora"].private  # private unless asked otherwise

    folder = download(hub, "tester/tiny-lora", tmp_path)
    assert {p.name for p in folder.iterdir()} == {".gitattributes", "README.md", "loss.png",
                                                   *adapter_format.FILES}
    checkpoint = latest_checkpoint(lora_job.job_dir)[1]
    weights = adapter_format.WEIGHTS_FILE
    assert (folder / weights).read_bytes() == (checkpoint / weights).read_bytes()
    # The served name, not this server's folder, is the base the config names.
    assert json.loads((folder / adapter_format.CONFIG_FILE).read_text())["base_model_name_or_path"] == "tiny"

    pushed = PeftModel.from_pretrained(base_model(), folder).eval()
    ours = apply_adapter(base_model(), checkpoint, merge_lora=False)
    assert torch.allclose(logits(pushed), logits(ours), atol=1e-6)
    assert (logits(pushed) - logits(base_model())).abs().max() > 1e-3  # the adapter does something


def test_the_card_says_which_job_params_data_and_loss(hub, pusher, lora_job, tmp_path):
    assert pusher().push(lora_job).status == "pushed"  # again: a repo this trainer created
    folder = download(hub, "tester/tiny-lora", tmp_path)
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "peft" and "lora" in card.data.tags
    assert card.data.base_model is None  # "tiny" is a local model, no Hub repo
    for fact in (lora_job.job_hash, lora_job.dataset_sha256, '"adapter_type": "lora"',
                 '"repo_id": "tester/tiny-lora"', "PeftModel.from_pretrained"):
        assert fact in card.text, fact
    history = job_info(lora_job).history
    assert len(history) == RECIPE["max_steps"]
    for point in history:
        assert f"| {point.step} | {point.loss:.6g} |" in card.text
    assert (folder / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_full_fine_tune_is_pushed_as_a_model_transformers_loads(hub, pusher, full_job, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    outcome = pusher(hub_allow_public=True).push(full_job)
    assert outcome.status == "pushed", outcome.error
    assert not hub.repos["tester/tiny-full"].private
    folder = download(hub, "tester/tiny-full", tmp_path)
    names = {p.name for p in folder.iterdir()}
    assert {MODEL_CONFIG_FILE, MODEL_WEIGHTS_FILE, "tokenizer.json", "README.md"} <= names
    assert not names & {adapter_format.WEIGHTS_FILE, adapter_format.CONFIG_FILE, TRAINING_STATE_FILE}

    pushed = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = apply_adapter(base_model(), latest_checkpoint(full_job.job_dir)[1])
    assert torch.allclose(logits(pushed), logits(ours), atol=1e-6)
    assert (logits(pushed) - logits(base_model())).abs().max() > 1e-3
    tokenizer = AutoTokenizer.from_pretrained(folder)
    theirs = AutoTokenizer.from_pretrained(tiny_model())
    assert tokenizer("Say hello.").input_ids == theirs("Say hello.").input_ids
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "transformers" and full_job.job_hash in card.text


def test_a_revision_is_a_branch_made_when_missing(hub, pusher, lora_job):
    job = aimed(lora_job, "tester/branches", revision="exp-1")
    outcome = pusher().push(job)
    assert outcome.status == "pushed" and outcome.revision == "exp-1", outcome.error
    assert adapter_format.WEIGHTS_FILE in hub.files("tester/branches", "exp-1")
    assert set(hub.files("tester/branches", "main")) == {".gitattributes"}  # main untouched
    assert pusher().push(job).status == "pushed"  # again: branch and repo exist


def someone_elses_model(hub: FakeHub, repo_id: str) -> dict[str, bytes]:
    """A repo made on the Hub outside this trainer (the operator's own model, say), with weights
    and a card; its files."""
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(repo_id, private=False)
    # An open file, not bytes: huggingface_hub sends it through LFS, which the fake Hub speaks.
    weights = io.BytesIO(b"the real model's weights")
    api.create_commit(repo_id, [CommitOperationAdd(path_in_repo=adapter_format.WEIGHTS_FILE,
                                                   path_or_fileobj=weights),
                                CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=b"# Ours\n")],
                      commit_message="the model")
    return hub.files(repo_id)


def test_an_existing_repo_this_trainer_did_not_create_is_not_written(hub, pusher, lora_job):
    before = someone_elses_model(hub, "tester/production")
    since = len(hub.calls)
    refused = pusher().push(aimed(lora_job, "tester/production", owner="tenant-a"))
    assert refused.status == "failed", refused
    assert "already exists" in refused.error and "LOOPLINE_HUB_ALLOW_EXISTING_REPOS" in refused.error
    assert hub.files("tester/production") == before and not hub.repos["tester/production"].private
    # The Hub was asked to create it (and said it exists), and nothing else: no file left the trainer.
    assert hub.calls[since:] == ["POST /api/repos/create"]

    allowed = pusher(hub_allow_existing_repos=True).push(aimed(lora_job, "tester/production"))
    assert allowed.status == "pushed", allowed.error  # the operator's allowance, and only that
    assert hub.files("tester/production")[adapter_format.WEIGHTS_FILE] != before[adapter_format.WEIGHTS_FILE]


def test_a_repo_created_for_one_key_is_not_written_for_another(hub, pusher, lora_job):
    mine = pusher().push(aimed(lora_job, "tenants/a-model", owner="a"))
    assert mine.status == "pushed", mine.error
    first = hub.files("tenants/a-model")

    theirs = pusher().push(aimed(lora_job, "tenants/a-model", owner="b"))
    assert theirs.status == "failed" and "LOOPLINE_HUB_ALLOW_EXISTING_REPOS" in theirs.error, theirs
    assert hub.files("tenants/a-model") == first
    assert pusher().push(aimed(lora_job, "tenants/a-model", owner="a")).status == "pushed"  # its own


def test_a_public_repo_needs_the_operators_allowance_at_the_push_too(hub, pusher, lora_job):
    # Allowed when the job was submitted, withdrawn since: the push asks the Hub nothing.
    since = len(hub.calls)
    refused = pusher().push(aimed(lora_job, "tester/public", private=False))
    assert refused.status == "failed" and "LOOPLINE_HUB_ALLOW_PUBLIC" in refused.error, refused
    assert hub.calls[since:] == [] and "tester/public" not in hub.repos


def test_a_refused_token_or_an_unreachable_hub_is_a_failed_push_that_says_why(pusher, tmp_path, lora_job):
    bad = tmp_path / "bad-token"
    bad.write_text("hf_not_a_valid_token")
    refused = pusher(bad).push(lora_job)
    assert refused.status == "failed" and "401" in refused.error, refused
    assert "hf_not_a_valid_token" not in refused.error

    closed = pusher(bad, endpoint="http://127.0.0.1:9").push(lora_job)
    assert closed.status == "failed" and "Connect" in closed.error, closed

    missing = pusher(tmp_path / "no-such-file").push(lora_job)
    assert missing.status == "failed" and "LOOPLINE_HUB_TOKEN_FILE" in missing.error


def test_a_link_planted_in_the_checkpoint_is_not_followed(hub, pusher, lora_job, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the trainer's own file\n")
    job_dir = tmp_path / "planted"
    step_dir = job_dir / CHECKPOINTS_DIR / checkpoint_name(3)
    step_dir.mkdir(parents=True)
    (step_dir / adapter_format.CONFIG_FILE).write_text("{}")
    (step_dir / adapter_format.WEIGHTS_FILE).symlink_to(secret)
    job = type(lora_job)(**{**aimed(lora_job, "tester/planted").__dict__, "job_dir": job_dir})
    outcome = pusher().push(job)
    assert outcome.status == "failed" and adapter_format.WEIGHTS_FILE in outcome.error, outcome
    assert "tester/planted" not in hub.repos  # refused before anything reached the Hub

    # checkpoints/ itself a link to a folder of the trainer's holding a whole, plain checkpoint
    # (here a real one): only not following that one link stands between it and the Hub.
    trainers = tmp_path / "trainers-folder"
    shutil.copytree(latest_checkpoint(lora_job.job_dir)[1], trainers / checkpoint_name(3))
    shutil.rmtree(job_dir / CHECKPOINTS_DIR)
    (job_dir / CHECKPOINTS_DIR).symlink_to(trainers)
    linked = pusher().push(job)
    assert linked.status == "failed" and CHECKPOINTS_DIR in linked.error, linked
    assert "tester/planted" not in hub.repos

"""``docker compose up`` for real: every image of docker-compose.yml built here from Debian's packages
(deploy/podman/build_images.py), the whole stack run by the compose v2 binary on podman, and used as
a user would through the gateway's published port: an OpenAI chat completion, a ScalarLM generate,
a ScalarLM training job on the compose Slurm served by its hash, a Tinker forward_backward and
sample; then ``down`` and ``up`` again, with deploy/compose/docker-compose.user-code.yml this time,
and everything earlier is still there; and a job that ships its own ml/ code runs as a uid of its
own, which reads neither the munge key nor another job's folder, and is served like any other.

``make compose-test`` runs it (root: podman); ``make test`` does not (tier ``compose``: it builds
images for minutes and runs the stack for more). It prints each step's time and every image's size.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from loopline.common.config.settings import TrainerSettings
from loopline.common.contracts.job_env import parse_uid_range
from loopline.common.local.launcher import free_port
from loopline.ml.models.resolve import resolve_model
from support.compose_stack import REPO, Compose, HealthChecks, compose_binary, podman_service
from support.stacks import MODELS_DIR
from support.training_data import archive, jsonlines

# Building the torch images takes ~10 minutes, a first start up to 25 (FIRST_UP_S).
pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the compose file's default
PROJECT = "loopline-compose-test"
WORK = REPO / ".loopline" / "compose-test"
# The first start converts SmolLM2 and compiles vLLM's graphs: 60-140 s measured on two CPUs; the
# inference image's start period allows 600 s.
FIRST_UP_S = 1500
PAIRS = [("What is the capital of Loopland?", " Loopville."), ("Who trains the loop?", " The trainer.")]
TRAIN_PARAMS = {"max_steps": 6, "learning_rate": 5e-3, "batch_size": 2, "gradient_accumulation_steps": 1,
                "steps_per_checkpoint": 6}
FINISHED = {"COMPLETED", "FAILED", "CANCELLED"}
USER_CODE = REPO / "deploy" / "compose" / "docker-compose.user-code.yml"
JOBS = "/var/lib/loopline/jobs"
# A job's own ml/ code: ml/ is first on the training program's PYTHONPATH, so this sitecustomize runs
# as its interpreter starts, as the job's uid. It records who it is and what it could reach into its
# job folder, then lets the installed loopline.ml train as usual.
PROBE = """
import json, os
job = os.environ.get("LOOPLINE_JOB_DIR")
if job:
    jobs = os.path.dirname(job)
    seen = {{"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}}
    def attempt(name, action):
        try:
            action()
            seen[name] = "done"
        except OSError as exc:
            seen[name] = type(exc).__name__
    attempt("read the munge key", lambda: open("/etc/munge-key/munge.key", "rb").read())
    attempt("list another job's folder", lambda: os.listdir(os.path.join(jobs, {other!r})))
    attempt("list the trainer's control folder", lambda: os.listdir(os.path.join(jobs, ".control")))
    attempt("write the jobs folder", lambda: open(os.path.join(jobs, "planted"), "w").close())
    seen["environ"] = dict(os.environ)
    with open(os.path.join(job, "probe-%d.json" % os.getpid()), "w") as f:
        f.write(json.dumps(seen) + "\\n")
"""


class Steps:
    """Each step's wall time, printed as it ends and again at the end."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    def __call__(self, name: str):
        steps = self

        class Step:
            def __enter__(self) -> None:
                self.started = time.monotonic()
                print(f"-- {name} ...", flush=True)

            def __exit__(self, exc_type, *_rest) -> None:
                seconds = time.monotonic() - self.started
                steps.times.append((name, seconds))
                print(f"-- {name}: {seconds:.1f} s{' (failed)' if exc_type else ''}", flush=True)

        return Step()

    def report(self) -> str:
        return "\n".join(f"  {name:<66} {seconds:8.1f} s" for name, seconds in self.times)


def env_file(port: int) -> Path:
    """The compose variables: fresh NATS and database passwords, the local NATS/PostgreSQL images."""
    passwords = subprocess.run([sys.executable, "-m", "loopline.common.runtime.nats_auth", "env"], check=True,
                               text=True, capture_output=True).stdout
    built = subprocess.run([sys.executable, str(REPO / "deploy/podman/build_images.py"), "--print-env"],
                           check=True, text=True, capture_output=True).stdout
    path = WORK / "compose.env"
    path.write_text(passwords + built + f"POSTGRES_PASSWORD={secrets.token_hex(16)}\n"
                    f"LOOPLINE_GATEWAY_PORT={port}\nSLURM_NODE_CPUS=2\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def steps() -> Iterator[Steps]:
    s = Steps()
    yield s
    print("\nstep times:\n" + s.report(), flush=True)


@pytest.fixture(scope="module")
def compose(steps: Steps) -> Iterator[Compose]:
    WORK.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(REPO / "deploy/podman/install.sh")], check=True, capture_output=True)
    binary = compose_binary()
    with steps("build every image (deploy/podman/build_images.py)"):
        builder = [sys.executable, str(REPO / "deploy/podman/build_images.py"), "--compose", str(binary)]
        subprocess.run(builder, check=True)
    with podman_service(WORK / "podman.sock") as docker_host:
        project = Compose(binary, PROJECT, env_file(free_port()), docker_host)
        project.run("down", "--volumes", "--remove-orphans", check=False)
        with HealthChecks(PROJECT):
            try:
                yield project
            finally:
                for service in ("gateway", "inference", "trainer", "slurm-compute"):
                    print(f"== {service} (last lines)\n{project.logs(service, 30)}", flush=True)
                project.run("down", "--volumes", "--remove-orphans", check=False, timeout_s=300)


def gateway_url(compose: Compose) -> str:
    port = next(line.split("=", 1)[1] for line in compose.env_file.read_text().splitlines()
                if line.startswith("LOOPLINE_GATEWAY_PORT="))
    return f"http://127.0.0.1:{port}"


def first_key(compose: Compose) -> str:
    """The key the gateway's first start printed (deploy/docker/gateway_keys.py)."""
    for line in compose.logs("gateway", 400).splitlines():
        word = line.split("|")[-1].strip()
        if word.startswith("tml-"):
            return word
    raise AssertionError(f"the gateway printed no key:\n{compose.logs('gateway')}")


def train(http: httpx.Client, files: dict[str, bytes]) -> dict:
    data = archive({"dataset.jsonlines": jsonlines([{"input": q, "output": a} for q, a in PAIRS]), **files})
    resp = http.post("/v1/megatron/train", files={"file": ("dataset", data, "application/octet-stream")},
                     data={"params": json.dumps(TRAIN_PARAMS)})
    assert resp.status_code == 200, resp.text
    return resp.json()


def uids(compose: Compose, states: dict[str, str]) -> dict[str, str]:
    return {service: compose.run("exec", "-T", service, "id", "-u").stdout.strip()
            for service, state in states.items() if state.startswith("running")}


def wait_job(http: httpx.Client, job: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    status: dict = {}
    while time.monotonic() < deadline:
        status = http.get(f"/v1/megatron/train/{job}").json()
        if status["job_status"]["status"] in FINISHED and status.get("deployed"):
            return status
        if status["job_status"]["status"] in {"FAILED", "CANCELLED"}:
            break
        time.sleep(2)
    raise AssertionError(f"job {job} not completed and deployed in {timeout_s:.0f} s: {status}")


def generate(http: httpx.Client, prompts: list[str], model: str | None = None) -> list[str]:
    """ScalarLM's generate and get_results, on the wire as the scalarlm client sends them (the
    client itself sends no API key, and compose's gateway requires one)."""
    body = {"prompts": prompts, "max_tokens": 12, **({"model": model} if model else {})}
    resp = http.post("/v1/generate", json=body)
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    ids = [r["request_id"] for r in results]
    deadline = time.monotonic() + 300
    while not all(r.get("response") is not None or r.get("error") for r in results):
        assert time.monotonic() < deadline, results
        time.sleep(1)
        results = http.post("/v1/generate/get_results", json={"request_ids": ids}).json()["results"]
    assert not [r for r in results if r.get("error")], results
    return [r["response"] for r in results]


def test_compose_up_serves_trains_and_keeps_its_state(compose: Compose, steps: Steps, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    with steps("docker compose up (first start: model conversion, vLLM)"):
        compose.run("up", "--detach", "--no-build", timeout_s=FIRST_UP_S)
        states = compose.wait_healthy(FIRST_UP_S)
    print(f"services: {json.dumps(states)}", flush=True)
    assert {"nats", "postgres", "gateway", "queue", "inference", "trainer", "checkpoint-watcher",
            "slurmctld", "slurm-compute"} <= states.keys()

    # Every service runs as a user of its own but slurmd, which must start jobs as their owners.
    users = uids(compose, states)
    print(f"uids: {json.dumps(users)}", flush=True)
    assert [service for service, uid in users.items() if uid == "0"] == ["slurm-compute"], users
    # Whoever reads the munge key can forge a Slurm credential for root: root's, 0440, group 10002.
    key = compose.run("exec", "-T", "slurm-compute", "stat", "-c", "%a %u %g", "/etc/munge-key/munge.key")
    assert key.stdout.strip() == "440 0 10002", key.stdout

    url = gateway_url(compose)
    key = first_key(compose)
    headers = {"Authorization": f"Bearer {key}"}
    http = httpx.Client(base_url=url, headers=headers, timeout=120)
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401, "compose's gateway must need a key"
    health = http.get("/v1/health").json()
    assert health["api"] == "up" and health["vllm"] == "up", health

    with steps("OpenAI chat completion"):
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
        chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=8, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0

    with steps("ScalarLM generate"):
        base_answers = generate(http, [q for q, _ in PAIRS])
        assert all(isinstance(a, str) for a in base_answers) and any(base_answers), base_answers

    with steps("ScalarLM training job on the compose Slurm, served by its hash"):
        job = train(http, {})["job_status"]["model_name"]
        status = wait_job(http, job, 900)
        assert status["job_status"]["status"] == "COMPLETED", status
        assert status["job_status"]["job_id"], "it ran through Slurm, so it has a Slurm job id"
        losses = [h["loss"] for h in status["job_status"]["history"]]
        assert len(losses) == TRAIN_PARAMS["max_steps"]
        tuned = generate(http, [q for q, _ in PAIRS], model=job)
        assert any(tuned), tuned
        served = oai.completions.create(model=job, prompt=PAIRS[0][0], max_tokens=12, temperature=0)
        assert served.choices[0].text == tuned[0]

    # The base file runs no job's own code: its trainer (uid 10001) could not give it a uid of its own.
    data = archive({"dataset.jsonlines": jsonlines([{"input": "a", "output": " b"}]),
                    "ml/sitecustomize.py": b"print('mine')\n"})
    refused = http.post("/v1/megatron/train", data={"params": json.dumps(TRAIN_PARAMS)},
                        files={"file": ("dataset", data, "application/octet-stream")})
    assert refused.status_code == 403 and "LOOPLINE_ALLOW_USER_CODE" in refused.text, refused.text

    with steps("Tinker forward_backward, optim_step and sample"):
        monkeypatch.setenv("TINKER_TELEMETRY", "0")
        service = tinker.ServiceClient(base_url=url, api_key=key)
        training = service.create_lora_training_client(base_model=MODEL, rank=8).result()
        # get_tokenizer() loads get_info's tokenizer_id on this machine: the model's Hub id, as a
        # client anywhere can (not the container's folder). This machine reaches no Hub, so the
        # tokenizer comes from the same package the image converts the model from.
        info = http.post("/api/v1/get_info", json={"model_id": training.model_id}, headers={"X-API-Key": key})
        assert info.json()["model_data"]["tokenizer_id"] == MODEL, info.text
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL, MODELS_DIR))
        tokens = tokenizer.encode("Loopline runs in containers.", add_special_tokens=True)
        weights = [1.0] * (len(tokens) - 1)
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens=tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
        result = training.forward_backward([datum], "cross_entropy").result()
        assert len(result.loss_fn_outputs) == 1
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(tokens=tokenizer.encode("Loopline", add_special_tokens=True))
        sample = sampler.sample(prompt=prompt, num_samples=1,
                                sampling_params=types.SamplingParams(max_tokens=6, temperature=0)).result()
        assert sample.sequences and sample.sequences[0].tokens
        run_id = training.model_id

    with steps("docker compose down (volumes kept)"):
        compose.run("down", timeout_s=300)
        assert not [c for c in compose.containers() if c.get("State") == "running"]

    with steps("docker compose up again, with user code on (docker-compose.user-code.yml)"):
        compose = replace(compose, overrides=(USER_CODE,))
        compose.run("up", "--detach", "--no-build", timeout_s=FIRST_UP_S)
        states = compose.wait_healthy(FIRST_UP_S)
    users = uids(compose, states)
    print(f"uids with user code on: {json.dumps(users)}", flush=True)
    assert sorted(s for s, uid in users.items() if uid == "0") == ["slurm-compute", "trainer"], users

    with steps("everything earlier is still there"):
        # The key (api-keys volume), the job, its history and its adapter (postgres, jobs), the same
        # answers from the adapter and the base model, the Tinker run (postgres).
        assert http.get("/v1/health").json()["vllm"] == "up"
        again = http.get(f"/v1/megatron/train/{job}").json()
        assert again["job_status"]["status"] == "COMPLETED" and again["job_status"]["history"] == \
            status["job_status"]["history"]
        assert job in {m["name"] for m in http.get("/v1/megatron/list_models").json()["models"]}
        assert generate(http, [q for q, _ in PAIRS], model=job) == tuned
        assert generate(http, [q for q, _ in PAIRS]) == base_answers
        run = http.get(f"/api/v1/training_runs/{run_id}", headers={"X-API-Key": key})
        assert run.status_code == 200, run.text
        assert run.json()["training_run_id"] == run_id

    with steps("a job's own ml/ code, run as a uid of its own, served by its hash"):
        reply = train(http, {"ml/sitecustomize.py": PROBE.format(other=job).encode()})
        assert reply["job_config"]["ml_code"] == "shipped", reply["job_config"]
        own = reply["job_status"]["model_name"]
        status = wait_job(http, own, 900)
        assert status["job_status"]["status"] == "COMPLETED", status
        assert any(generate(http, [q for q, _ in PAIRS], model=own))
    probes = compose.run("exec", "-T", "slurm-compute", "sh", "-c", f"cat {JOBS}/{own}/probe-*.json").stdout
    seen = [json.loads(line) for line in probes.splitlines() if line.strip()]
    print(f"what the job's code saw: {json.dumps([{**p, 'environ': sorted(p['environ'])} for p in seen])}",
          flush=True)
    # The stack's secrets (NATS and database passwords): none reached the job's environment.
    passwords = [line.split("=", 1)[1] for line in compose.env_file.read_text().splitlines()
                 if "PASSWORD" in line.split("=", 1)[0]]
    assert passwords
    first, count = parse_uid_range(TrainerSettings.model_fields["job_uid_range"].default)
    assert seen, probes
    for probe in seen:
        assert first <= probe["uid"] < first + count and probe["gid"] == probe["uid"], probe
        assert probe["groups"] == [], probe
        assert probe["read the munge key"] == "PermissionError", probe
        assert probe["list another job's folder"] == "PermissionError", probe
        assert probe["list the trainer's control folder"] == "PermissionError", probe
        assert probe["write the jobs folder"] == "PermissionError", probe
        assert not [word for word in passwords if word in json.dumps(probe["environ"])], probe["environ"]
    owner = compose.run("exec", "-T", "slurm-compute", "stat", "-c", "%u %g %a", f"{JOBS}/{own}")
    assert owner.stdout.split() == [str(seen[0]["uid"]), "10001", "2750"], owner.stdout

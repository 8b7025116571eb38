"""A property-based fuzz run over the gateway's routes: schemathesis, against the OpenAPI document the
gateway serves, on a real stack with the tiny model. No request may get a 5xx (``not_a_server_error``)
or a status its route does not document (``status_code_conformance``).

Bounded and repeatable: MAX_EXAMPLES cases per operation (valid and invalid ones), a fixed seed, one
worker. Measured on two cores: 10 cases per operation took 38 s quiet and 95 s under load, plus
about a minute to start the stack. A failure's message holds the command that replays the run and
schemathesis's report of each failing request (with a curl line to send it again).

Every route is fuzzed but those in EXCLUDED (which says why). The training routes are in: no random
body can start a real job (one needs a tar archive that holds a valid dataset), so they answer with
their refusals, as they would to a client's mistakes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

SEED = 20261124
MAX_EXAMPLES = 15
CHECKS = "not_a_server_error,status_code_conformance"
# path -> why the fuzz run cannot test it
EXCLUDED = {
    "/v1/megatron/events": "every job's events, a stream that does not end by itself: a request to it "
                           "never completes, whatever it sends",
    "/v1/tinker/events": "every session worker's events, a stream that does not end by itself",
    "/ui/live": "an open dashboard page's updates, a stream that does not end by itself",
}
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fuzz_stack(two_deployments_stack):
    # The run clears the queue and names random jobs to cancel, delete and restart (a prefix of a
    # real job would match it): the stack is shared only with test_deployments, which has no job and
    # runs before it. A short context (LOOPLINE_MAX_MODEL_LEN=256) bounds each case: a valid request
    # that names no max_tokens generates up to the context's end (2048 tokens, 5-15 s here; one
    # operation's valid cases took minutes). The embedding model beside it, so the pooling routes
    # reach a vLLM that serves them.
    return two_deployments_stack


def test_no_route_answers_a_5xx_or_an_undocumented_status(fuzz_stack, tmp_path):
    models = httpx.get(f"{fuzz_stack.url}/v1/models", timeout=30).json()["data"]
    served = next(m["id"] for m in models if "generate" in m["tasks"])
    embed = next(m["id"] for m in models if "embed" in m["tasks"])
    reports = tmp_path / "reports"
    command = [
        str(Path(sys.executable).with_name("st")), "run", f"{fuzz_stack.url}/openapi.json",
        "--checks", CHECKS, "--phases", "fuzzing", "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED),
        "--workers", "1", "--request-timeout", "60", "--report", "json", "--report-dir", str(reports),
        *(arg for path in EXCLUDED for arg in ("--exclude-path", path)),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "support.fuzz_hooks", "LOOPLINE_FUZZ_MODEL": served,
           "LOOPLINE_FUZZ_EMBED_MODEL": embed,
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    # In tmp_path: Hypothesis keeps an example database in the working directory, and one left from
    # an earlier run would be replayed first (the seed alone must decide what is sent).
    run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    report = json.loads(next(reports.glob("json-*.json")).read_text())
    figures = (f"{report['operations']['tested']} operations, {report['test_cases']['generated']} cases, "
               f"{report['test_cases']['with_failures']} failing, {len(report['errors'])} errors")
    print(f"fuzz run: {figures}")
    replay = (f"SCHEMATHESIS_HOOKS=support.fuzz_hooks LOOPLINE_FUZZ_MODEL={served} "
              f"LOOPLINE_FUZZ_EMBED_MODEL={embed} PYTHONPATH=tests "
              f"{' '.join(command)}")
    assert run.returncode == 0 and report["complete"], (
        f"{figures}\nreplay (on a running stack): {replay}\n{run.stdout[-20000:]}\n{run.stderr[-2000:]}")
    assert report["operations"]["tested"] == report["operations"]["selected"] >= 30

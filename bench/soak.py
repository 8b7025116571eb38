"""Soak: mixed load with periodic faults for a long while; nothing may grow without bound and every
accepted request must be answered.

    python bench/soak.py [--minutes 30] [--fault-every 150] [--faults replica,gateway,...] \
        [--model tiny] [--replicas 1] [--sample-every 300] [--out bench/results/soak.json]

One ``LocalStack`` (training jobs under the local launcher). Load: ``--openai-clients`` clients of
the ``openai`` package cycling completions and chat, streaming and not; one ScalarLM client
submitting ``--batch-size``-prompt batches to ``/v1/generate`` and polling ``get_results`` until every
prompt is answered (then checking RESULTS holds each answer once); a small training job through the
``scalarlm`` client every ``--train-every`` seconds, followed until it ends. Every ``--fault-every``
seconds one fault, the kinds in a seeded shuffled order: ``kill -9`` of a random replica, the
gateway, the queue, the trainer or the checkpoint-watcher, each started again at once, or
nats-server restarted on its data. Clients retry through faults as a patient client does.

Sampled after ``--warmup`` seconds of load (start), every ``--sample-every`` seconds, and at the end
once the load has drained: each service's RSS and open fds (its process tree), each JetStream
stream's messages, bytes and consumers, nats-server's /varz. Printed: requests per kind, the
faults, the start/end table and the trend; written: all of it as JSON. Exits 1 naming each breach:
a request unanswered by its deadline, rejected, or answered twice; a training job that failed; a
service whose RSS grew past ``--rss-ratio``, whose fds grew past ``--fd-slack``; a stream whose
consumers grew past ``--consumer-slack``; WORK messages left after the drain.

The reusable part (load, probes, faults, verdict) is tests/support/soak_*.py, which
tests/e2e/test_soak.py runs for a minute and a half in ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))  # support.soak_*: the same code the soak test runs
# bench/tinker.py shares the SDK's name: with this folder on sys.path ``import tinker`` would find it.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from support.soak_probe import Limits  # noqa: E402 - after the path it needs
from support.soak_run import FAULT_KINDS, SoakConfig, soak, summary  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="what LOOPLINE_MODEL takes")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the start sample")
    parser.add_argument("--fault-every", type=float, default=150.0, help="seconds; 0 for none")
    parser.add_argument("--faults", default=",".join(FAULT_KINDS), help="comma-separated kinds")
    parser.add_argument("--sample-every", type=float, default=300.0, help="seconds")
    parser.add_argument("--openai-clients", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--train-every", type=float, default=300.0, help="seconds; 0 for no training")
    parser.add_argument("--tinker-every", type=float, default=60.0,
                        help="seconds between a Tinker session's steps; 0 for no session")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--answer-deadline", type=float, default=240.0, help="seconds")
    parser.add_argument("--rss-ratio", type=float, default=Limits.rss_ratio)
    parser.add_argument("--fd-slack", type=int, default=Limits.fd_slack)
    parser.add_argument("--consumer-slack", type=int, default=Limits.consumer_slack)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    parser.add_argument("--state-dir", type=Path, default=None)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from loopline.common.local.stack import LocalStack
    from loopline.ml.models.resolve import resolve_model

    config = SoakConfig(
        minutes=args.minutes, warmup_s=args.warmup, fault_every_s=args.fault_every,
        faults=tuple(k.strip() for k in args.faults.split(",") if k.strip()),
        sample_every_s=args.sample_every, openai_clients=args.openai_clients, batch_size=args.batch_size,
        train_every_s=args.train_every, tinker_every_s=args.tinker_every, max_tokens=args.max_tokens,
        answer_deadline_s=args.answer_deadline,
        seed=args.seed, limits=Limits(rss_ratio=args.rss_ratio, fd_slack=args.fd_slack,
                                      consumer_slack=args.consumer_slack))
    models_dir = REPO / ".loopline" / "models"
    model = str(resolve_model(args.model, models_dir))
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="loopline-soak-"))
    # Training jobs as local processes: the soak needs no Slurm.
    stack = LocalStack(state_dir, model, replicas=args.replicas, models_dir=models_dir,
                       env={"LOOPLINE_LAUNCHER": "local"})
    print(f"starting LocalStack in {state_dir} ({model}); soak of {args.minutes} min, a fault every "
          f"{args.fault_every} s from {', '.join(config.faults)}", flush=True)
    stack.start()
    try:
        report = asyncio.run(soak(stack, config))
    finally:
        stack.stop()
    print(summary(report), "", report["table"], "", report["trend"], "", sep="\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": model, "state_dir": str(state_dir), **report}, indent=2) + "\n")
    print(f"figures written to {args.out}")
    if report["breaches"]:
        print("FAIL: " + "; ".join(report["breaches"]))
        return 1
    print("PASS: every request answered (each ScalarLM answer stored once), nothing grew past its limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())

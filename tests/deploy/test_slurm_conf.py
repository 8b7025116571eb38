"""The Slurm configuration: compose's file and the chart's ConfigMap say the same thing, and the
settings the images and the trainer rely on are there."""

from __future__ import annotations

from support.deploy import ROOT

# Allowed to differ: where the controller is, and how many nodes the chart may register.
PER_DEPLOYMENT = {"SlurmctldHost", "MaxNodeCount"}


def parse(text: str) -> dict[str, str]:
    conf = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition("=")
            conf[key] = value
    return conf


def _chart_conf(chart: dict) -> dict[str, str]:
    configmap = next(o for o in chart["objects"]
                     if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "demo-loopline-slurm")
    return parse(configmap["data"]["slurm.conf"])


def test_compose_and_chart_agree(charts):
    compose = parse((ROOT / "deploy/slurm/slurm.conf").read_text())
    for name, chart in charts.items():
        rendered = _chart_conf(chart)
        differ = {k for k in compose.keys() | rendered.keys() if compose.get(k) != rendered.get(k)}
        assert differ <= PER_DEPLOYMENT, f"{name}: {sorted(differ - PER_DEPLOYMENT)} differ"


def test_what_the_containers_rely_on():
    conf = parse((ROOT / "deploy/slurm/slurm.conf").read_text())
    # Containers: no systemd, no cgroup tree of their own.
    assert conf["ProctrackType"] == "proctrack/linuxproc" and conf["TaskPlugin"] == "task/none"
    # Dynamic nodes (slurmd -Z in deploy/slurm/loopline-slurm), addressed by their registration.
    assert "NodeName" not in conf and "cloud_reg_addrs" in conf["SlurmctldParameters"]
    assert conf["GresTypes"] == "gpu"
    # The controller image runs slurmctld as `slurm`; the paths are the ones the images prepare.
    assert conf["SlurmUser"] == "slurm" and conf["AuthType"] == "auth/munge"
    assert conf["StateSaveLocation"] == "/var/spool/slurmctld"
    # The trainer reconciles through squeue; without slurmdbd, finished jobs must linger there.
    assert int(conf["MinJobAge"]) >= 300
    assert conf["PartitionName"].split()[0] == "loopline"

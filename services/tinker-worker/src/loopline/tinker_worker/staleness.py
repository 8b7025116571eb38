"""How many optimizer steps behind the trainer each trained sample was (issue 26, async RL).

A datum's provenance names the sampled sequences it trains (``<request id>:<i>``, the cookbook sends
it on every RL datum); each sample request carries the version of the weights that drew it
(contracts/sampler_version.py, stamped by the gateway). A sequence drawn from this run's weights
saved at step s, trained while the run is at step t, is t - s steps stale: 0 on-policy, up to
``max_steps_off_policy`` in the cookbook's async mode. Sequences of other weights (the base model,
another run, an unknown or expired request) are counted apart, as unstamped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from tinker import types as tt

from loopline.common.contracts import subjects
from loopline.common.contracts.sampler_version import SamplerVersion

from .provenance import SEQUENCE_ID

log = logging.getLogger(__name__)

# Sample requests looked up per call: a batch names a few dozen; a body naming more (each a NATS
# read) has the rest counted unstamped rather than slowing the worker.
MAX_LOOKUPS = 1024


@dataclass
class Tally:
    behind: Counter[int] = field(default_factory=Counter)  # steps behind -> trained sequences
    unstamped: int = 0

    def add(self, other: Tally) -> None:
        self.behind.update(other.behind)
        self.unstamped += other.unstamped

    def metrics(self) -> dict[str, float]:
        """As optim_step metrics (the cookbook logs those with each step)."""
        if not self.behind:
            return {}
        count = sum(self.behind.values())
        return {"staleness:mean": sum(k * n for k, n in self.behind.items()) / count,
                "staleness:max": float(max(self.behind))}


def sampled_sequences(data: list[tt.Datum]) -> dict[str, str]:
    """The sampled sequences the data's provenance names -> their request id (ids this server did
    not make are left out: only stable_reinforce refuses them)."""
    found: dict[str, str] = {}
    for datum in data:
        for span in datum.loss_fn_input_spans or []:
            match = SEQUENCE_ID.fullmatch(span.sequence_id)
            if isinstance(span, tt.SampledProvenanceSpan) and match is not None:
                found[span.sequence_id] = match["rid"]
    return found


async def versions(js: JetStreamContext, rids: set[str]) -> dict[str, SamplerVersion]:
    """The stamped version of each of these sample requests that has one."""
    async def one(rid: str) -> SamplerVersion | None:
        try:
            stored = await js.get_last_msg(subjects.TINKER_FUTURES_STREAM,
                                           subjects.tinker_sample_request(rid), direct=True)
        except NotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - a count, never a reason to fail a trained call
            # The gradient is already added: failing the call now would have the SDK send it again.
            log.warning("the sampler version of sample request %s could not be read: %s", rid, exc)
            return None
        return SamplerVersion.of_headers(stored.headers)

    asked = sorted(rids)[:MAX_LOOKUPS]
    found = await asyncio.gather(*(one(rid) for rid in asked))
    return {rid: v for rid, v in zip(asked, found, strict=True) if v is not None}


def tally(sequences: dict[str, str], stamps: dict[str, SamplerVersion], model_id: str, step: int) -> Tally:
    """Each sequence's steps behind ``step`` when drawn from this run's weights at or before it."""
    out = Tally()
    for rid in sequences.values():
        version = stamps.get(rid)
        if version is not None and version.model_id == model_id and version.step <= step:
            out.behind[step - version.step] += 1
        else:
            out.unstamped += 1
    return out


async def of_call(js: JetStreamContext, data: list[tt.Datum], model_id: str, step: int) -> Tally:
    """The staleness of the sequences a forward_backward trains, at the run's current ``step``."""
    sequences = sampled_sequences(data)
    if not sequences:
        return Tally()
    return tally(sequences, await versions(js, set(sequences.values())), model_id, step)

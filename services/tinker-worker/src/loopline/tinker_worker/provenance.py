"""StableReinforce's data against what sampling recorded (``record_stability_info``).

A datum's provenance names, run by run, the sampled sequence (``<request id>:<i>``) each of its
positions came from. Before a ``stable_reinforce`` pass each run is checked against that request's
SampledRecord: it belongs to the model's session and owner, lies inside the recorded prompt or
sample, and the datum's tokens there are the recorded ones. The sampler's recorded logprobs then
replace the datum's ``logprobs`` on its sampled targets: the loss weighs the learner against what
the sampler computed, not against what the client kept. Every fault is the caller's (UserError).
"""

from __future__ import annotations

import base64
import re
from dataclasses import replace

import numpy as np
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from tinker import types as tt

from loopline.common.contracts import subjects
from loopline.common.contracts.tinker_schemas import SampledRecord, TinkerModel

from .losses import TARGETS
from .types import UserError

# What this server hands out (the asample reply's sample_sequence_ids): <group>_<index>:<sample>.
# Nothing else may reach a subject, where "*", ">" or "." would name other requests' records.
SEQUENCE_ID = re.compile(r"(?P<rid>[0-9a-f]{32}(?:[0-9a-f]{32})?_[0-9]{1,18}):(?P<sample>[0-9]{1,9})")


class Recorded:
    """One SampledRecord's arrays."""

    def __init__(self, record: SampledRecord):
        self.record = record
        self.prompt = _ints(record.prompt_b64)
        self.tokens = [_ints(t) for t in record.tokens_b64]
        self.logprobs = [np.frombuffer(base64.b64decode(lp), dtype="<f4") for lp in record.logprobs_b64]


def _ints(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype="<i4").astype(np.int64)


def request_ids(data: list[tt.Datum]) -> set[str]:
    """The sample requests a call's provenance names; UserError on an id this server never made."""
    found: set[str] = set()
    for i, datum in enumerate(data):
        for span in [*(datum.model_input_spans or []), *(datum.loss_fn_input_spans or [])]:
            match = SEQUENCE_ID.fullmatch(span.sequence_id)
            if match is None:
                shown = span.sequence_id[:80]
                raise UserError(f"datum {i}: provenance names sequence {shown!r}, not a sequence id this "
                                "server returned (<request id>:<sample>)")
            found.add(match["rid"])
    return found


async def load(js: JetStreamContext, rids: set[str]) -> dict[str, Recorded]:
    """The records of these sample requests that exist (expired or never recorded ones are absent)."""
    records: dict[str, Recorded] = {}
    for rid in sorted(rids):
        try:
            raw = await js.get_last_msg(subjects.TINKER_FUTURES_STREAM, subjects.tinker_sample_record(rid),
                                        direct=True)
        except NotFoundError:
            continue
        records[rid] = Recorded(SampledRecord.model_validate_json(raw.data or b"{}"))
    return records


def apply(data: list[tt.Datum], records: dict[str, Recorded], model: TinkerModel) -> list[tt.Datum]:
    """``data`` with the recorded sampler logprobs on every sampled target; UserError naming the
    datum and run where the provenance does not match the records. Data without provenance pass
    unchanged (the loss refuses them, naming the datum)."""
    out = []
    for i, datum in enumerate(data):
        if datum.loss_fn_input_spans is None:
            out.append(datum)
            continue
        tokens = np.asarray(datum.model_input.to_ints(), dtype=np.int64)
        targets = datum.loss_fn_inputs[TARGETS].to_numpy() if TARGETS in datum.loss_fn_inputs else None
        if datum.model_input_spans is not None:
            _check_runs(i, "model_input_spans", datum.model_input_spans, tokens, records, model, None)
        if targets is None or targets.ndim != 1:
            out.append(datum)  # the loss's own checks name what is wrong with the targets
            continue
        logprobs = np.zeros(len(targets), dtype=np.float32)
        if "logprobs" in datum.loss_fn_inputs:
            logprobs = datum.loss_fn_inputs["logprobs"].to_numpy().astype(np.float32).copy()
        if logprobs.shape != targets.shape:
            out.append(datum)
            continue
        _check_runs(i, "loss_fn_input_spans", datum.loss_fn_input_spans, targets, records, model, logprobs)
        inputs = {**datum.loss_fn_inputs, "logprobs": tt.TensorData.from_numpy(logprobs)}
        out.append(replace(datum, loss_fn_inputs=inputs))
    return out


def _check_runs(i: int, field: str, spans: tt.ProvenanceSpans, tokens: np.ndarray,
                records: dict[str, Recorded], model: TinkerModel, logprobs: np.ndarray | None) -> None:
    """Each run of ``spans`` against its record; with ``logprobs``, the recorded logprobs of its
    sampled runs are written into it."""
    start = 0
    # Invariant: the runs before this one cover positions [0, start) of tokens and were checked.
    for j, span in enumerate(spans):
        where = f"datum {i}: {field}[{j}] ({span.sequence_id})"
        end = start + span.length
        if end > len(tokens):
            raise UserError(f"{where}: the runs cover more than the datum's {len(tokens)} positions")
        match = SEQUENCE_ID.fullmatch(span.sequence_id)
        assert match is not None, "request_ids() checked every sequence id"
        recorded = records.get(match["rid"])
        if recorded is None:
            raise UserError(f"{where}: that sequence was not recorded; sample with "
                            "record_stability_info=True (records are kept for a day)")
        if recorded.record.session_id != model.session_id or recorded.record.owner != model.owner:
            raise UserError(f"{where}: that sequence was sampled outside this model's session; provenance "
                            "works only within one session")
        sample = int(match["sample"])
        if sample >= len(recorded.tokens):
            raise UserError(f"{where}: its request drew {len(recorded.tokens)} samples")
        source = recorded.tokens[sample] if isinstance(span, tt.SampledProvenanceSpan) else recorded.prompt
        kind = "sampled tokens" if isinstance(span, tt.SampledProvenanceSpan) else "prompt"
        if span.offset + span.length > len(source):
            raise UserError(f"{where}: positions [{span.offset}, {span.offset + span.length}) are past the "
                            f"{len(source)} recorded {kind}")
        if not np.array_equal(tokens[start:end], source[span.offset:span.offset + span.length]):
            raise UserError(f"{where}: the datum's tokens there are not the recorded {kind}")
        if logprobs is not None and isinstance(span, tt.SampledProvenanceSpan):
            logprobs[start:end] = recorded.logprobs[sample][span.offset:span.offset + span.length]
        start = end

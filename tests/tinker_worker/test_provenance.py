"""StableReinforce's provenance: spans on the wire (the SDK's own encoding) reach the worker, and a
datum's runs are checked against the gateway's SampledRecord of the request they name, whose
recorded logprobs replace the client's on sampled targets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tinker import types as tt

from loopline.common.contracts.tinker_schemas import LoraSpec, TinkerModel
from loopline.gateway.tinker.proto import SampledSeq, encode_sample_response
from loopline.gateway.tinker.stability import record_of
from loopline.tinker_worker.proto import RequestBounds, decode_forward_backward
from loopline.tinker_worker.provenance import Recorded, apply, request_ids
from loopline.tinker_worker.types import UserError
from support.tinker_data import sdk_body

RID = "0123456789abcdef0123456789abcdef_000000000"
PROMPT = [5, 6, 7]
SAMPLES = [[11, 12, 13], [21, 22]]
LOGPROBS = [[-0.5, -1.25, -2.0], [-0.75, -3.5]]


def _model(session: str = "sess", owner: str | None = "alice") -> TinkerModel:
    return TinkerModel(model_id="m", session_id=session, base_model="tiny", model_path="/m",
                       model_name="tiny", lora=LoraSpec(rank=4), worker_id="w", owner=owner)


def _records(session: str | None = "sess", owner: str | None = "alice") -> dict[str, Recorded]:
    request = tt.SampleRequest(prompt=tt.ModelInput.from_ints(PROMPT), num_samples=2,
                               sampling_params=tt.SamplingParams(max_tokens=3), record_stability_info=True)
    response = encode_sample_response([SampledSeq(tokens=t, stop_reason="length", logprobs=lp)
                                       for t, lp in zip(SAMPLES, LOGPROBS, strict=True)])
    return {RID: Recorded(record_of(RID, request, response, session, owner))}


def _datum(sample: int = 0, client_logprobs: float = 0.0) -> tt.Datum:
    """The cookbook's datum for one sample: prompt + sample shifted by one, with provenance."""
    seq = f"{RID}:{sample}"
    full = PROMPT + SAMPLES[sample]
    n = len(full) - 1
    datum = tt.Datum(model_input=tt.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": np.asarray(full[1:], dtype=np.int64),
        "logprobs": np.full(n, client_logprobs, dtype=np.float32),
        "advantages": np.ones(n, dtype=np.float32)})
    k = len(SAMPLES[sample])
    return datum.with_provenance(
        model_input=[tt.PromptProvenanceSpan(sequence_id=seq, length=3),
                     tt.SampledProvenanceSpan(sequence_id=seq, length=k - 1)],
        loss_fn_inputs=[tt.PromptProvenanceSpan(sequence_id=seq, offset=1, length=2),
                        tt.SampledProvenanceSpan(sequence_id=seq, length=k)])


def test_spans_cross_the_wire_and_the_recorded_logprobs_replace_the_clients():
    body = sdk_body([_datum(1, client_logprobs=-9.0)], loss_fn="stable_reinforce")
    [decoded] = decode_forward_backward(body, RequestBounds(1 << 30)).data
    assert decoded.loss_fn_input_spans == _datum(1).loss_fn_input_spans
    assert request_ids([decoded]) == {RID}
    [out] = apply([decoded], _records(), _model())
    # The prompt targets keep the client's values (they are not trained); the sampled ones are the record's.
    assert out.loss_fn_inputs["logprobs"].to_numpy().tolist() == [-9.0, -9.0, -0.75, -3.5]
    assert out.loss_fn_input_spans == decoded.loss_fn_input_spans


def _with_targets(datum: tt.Datum, targets: list[int]) -> tt.Datum:
    return dataclasses.replace(datum, loss_fn_inputs={**datum.loss_fn_inputs,
                                                      "target_tokens": np.asarray(targets, dtype=np.int64)})


def _with_span(datum: tt.Datum, span: tt.SampledProvenanceSpan) -> tt.Datum:
    assert datum.loss_fn_input_spans is not None
    return dataclasses.replace(datum, loss_fn_input_spans=[datum.loss_fn_input_spans[0], span])


@pytest.mark.parametrize(("datum", "records", "model", "message"), [
    (_with_targets(_datum(0), [6, 7, 11, 12, 99]), _records(), _model(), "not the recorded sampled tokens"),
    (_with_targets(_datum(0), [6, 8, 11, 12, 13]), _records(), _model(), "not the recorded prompt"),
    (_datum(0), {}, _model(), "was not recorded; sample with record_stability_info=True"),
    (_datum(0), _records(session="other"), _model(), "outside this model's session"),
    (_datum(0), _records(session=None), _model(), "outside this model's session"),
    (_datum(0), _records(owner="mallory"), _model(), "outside this model's session"),
    (_with_span(_datum(0), tt.SampledProvenanceSpan(sequence_id=f"{RID}:5", length=3)), _records(), _model(),
     "its request drew 2 samples"),
    (_with_span(_datum(0), tt.SampledProvenanceSpan(sequence_id=f"{RID}:0", offset=1, length=3)), _records(),
     _model(), "positions [1, 4) are past the 3 recorded sampled tokens"),
])
def test_provenance_that_does_not_match_the_record_is_a_user_error(datum, records, model, message):
    with pytest.raises(UserError, match="datum 0") as caught:
        apply([datum], records, model)
    assert message in str(caught.value)


@pytest.mark.parametrize("sequence_id", ["tinker.futures.>", "*", f"{RID}.x:0", f"{RID}:0:1", "abc:0"])
def test_a_sequence_id_this_server_never_made_is_refused_before_any_lookup(sequence_id):
    datum = _with_span(_datum(0), tt.SampledProvenanceSpan(sequence_id=sequence_id, length=3))
    with pytest.raises(UserError, match="not a sequence id this server returned"):
        request_ids([datum])

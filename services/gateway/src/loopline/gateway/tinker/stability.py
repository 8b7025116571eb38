"""``record_stability_info``: what a sample request that asks for it keeps for StableReinforce.

Tinker records "minimal additional information captured at sampling time" for each sequence and
trains on a datum's tokens only where its provenance names a recorded one (docs/tinker.md, "GSPO and
StableReinforce"). Here that record is the request's prompt, each sample's tokens and the sampler's
logprobs of them, with the sampler's Tinker session and owner, stored beside the request's future
(``tinker.futures.<request id>.record``, kept as long: a day). It is written when the answer is
first turned into the SDK's SampleResponse, which is when its tokens are known; the session worker
reads it when a forward_backward names one of its sequences (``<request id>:<i>``).
"""

from __future__ import annotations

import base64
import logging

import numpy as np
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from loopline.common.contracts import subjects
from loopline.common.contracts.tinker_schemas import SampledRecord
from loopline.common.runtime import bus
from loopline.gateway.gateway import Gateway
from loopline.gateway.tinker.sampling import prompt_tokens

log = logging.getLogger(__name__)


def _b64(values: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode()


def record_of(rid: str, request: tt.SampleRequest, response: bytes, session_id: str | None,
              owner: str | None) -> SampledRecord:
    """The record of a sample request from the SampleResponse bytes made for it."""
    message = pb.SampleResponse()
    message.ParseFromString(response)
    return SampledRecord(
        request_id=rid, session_id=session_id, owner=owner,
        prompt_b64=_b64(np.asarray(prompt_tokens(request)), "<i4"),
        tokens_b64=[base64.b64encode(seq.tokens).decode() for seq in message.sequences],
        logprobs_b64=[base64.b64encode(seq.logprobs).decode() for seq in message.sequences])


async def keep(gateway: Gateway, rid: str, request: tt.SampleRequest, response: bytes) -> None:
    """Store the record of a sample request that asked for one (once: a second retrieve of the same
    future is deduplicated by its message id). A record that cannot be stored is logged, not
    raised: the samples are still answered, and training on them says they were not recorded."""
    sampler = None
    if request.sampling_session_id is not None:
        sampler = await gateway.tinker.store.sampler(request.sampling_session_id)
    record = record_of(rid, request, response, sampler.session_id if sampler else None,
                       sampler.owner if sampler else None)
    try:
        await bus.publish_durable(gateway.js, subjects.tinker_sample_record(rid),
                                  record.model_dump_json().encode(), msg_id=f"{rid}.record", deadline_s=30)
    except Exception:  # too large for one message, or the bus is away
        log.exception("the stability record of sample %s was not stored", rid)

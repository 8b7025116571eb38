"""The staleness count of trained samples (staleness.py) and the stamp it reads (sampler_version.py);
tests/e2e/test_tinker_staleness.py shows it through a stack."""

from __future__ import annotations

import pytest
from tinker import types as tt

from loopline.common.contracts.sampler_version import MODEL_HEADER, STEP_HEADER, SamplerVersion
from loopline.tinker_worker.staleness import Tally, sampled_sequences, tally

OLD, NEW, BASE = ("a" * 32 + "_0", "b" * 32 + "_0", "c" * 32 + "_0")


def _datum(*sequence_ids: str) -> tt.Datum:
    """A datum whose targets are a prompt then one sampled run per sequence id."""
    n = 2 + 3 * len(sequence_ids)
    datum = tt.Datum(model_input=tt.ModelInput.from_ints(list(range(n))),
                     loss_fn_inputs={"target_tokens": list(range(1, n + 1))})
    first = sequence_ids[0]
    return datum.with_provenance(
        model_input=[tt.PromptProvenanceSpan(sequence_id=first, length=n)],
        loss_fn_inputs=[tt.PromptProvenanceSpan(sequence_id=first, length=2),
                        *(tt.SampledProvenanceSpan(sequence_id=s, length=3) for s in sequence_ids)])


def test_sampled_sequences_are_named_once_and_foreign_ids_left_out():
    data = [_datum(f"{OLD}:0", f"{OLD}:1"), _datum(f"{OLD}:0"), _datum(f"{NEW}:0"), _datum("not-ours:0"),
            tt.Datum(model_input=tt.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2]})]
    assert sampled_sequences(data) == {f"{OLD}:0": OLD, f"{OLD}:1": OLD, f"{NEW}:0": NEW}


def test_steps_behind_count_this_runs_weights_only():
    sequences = {f"{OLD}:0": OLD, f"{OLD}:1": OLD, f"{NEW}:0": NEW, f"{BASE}:0": BASE, "x:0": "x"}
    stamps = {OLD: SamplerVersion("run", 3), NEW: SamplerVersion("run", 5), BASE: SamplerVersion("other", 5)}
    got = tally(sequences, stamps, "run", 5)
    assert got.behind == {2: 2, 0: 1} and got.unstamped == 2
    assert got.metrics() == {"staleness:mean": pytest.approx(4 / 3), "staleness:max": 2.0}
    # Weights saved after the step being trained (a state loaded from before them) are not this run's past.
    assert tally({f"{NEW}:0": NEW}, stamps, "run", 4).unstamped == 1


def test_tallies_add_up_and_an_empty_one_adds_no_metrics():
    total = Tally()
    total.add(tally({f"{OLD}:0": OLD}, {OLD: SamplerVersion("run", 1)}, "run", 2))
    total.add(tally({f"{NEW}:0": NEW}, {}, "run", 2))
    assert total.behind == {1: 1} and total.unstamped == 1
    assert Tally().metrics() == {}


@pytest.mark.parametrize("headers", [None, {}, {MODEL_HEADER: "run"}, {STEP_HEADER: "3"},
                                     {MODEL_HEADER: "run", STEP_HEADER: "-1"},
                                     {MODEL_HEADER: "", STEP_HEADER: "3"}])
def test_a_request_without_a_whole_stamp_has_none(headers):
    assert SamplerVersion.of_headers(headers) is None


def test_the_stamp_round_trips_through_headers():
    version = SamplerVersion("run", 7)
    assert SamplerVersion.of_headers(version.headers()) == version


class _Stream:
    """A stand-in for JetStream's last-message read, inside this unit test of ``versions`` only:
    each request stamped at step 1, one read failing, one request unknown."""

    def __init__(self, failing: str, missing: str):
        self.failing, self.missing, self.reads = failing, missing, 0

    async def get_last_msg(self, stream: str, subject: str, direct: bool = False):
        from nats.js.api import RawStreamMsg
        from nats.js.errors import NotFoundError

        self.reads += 1
        if self.failing in subject:
            raise TimeoutError("the bus is away")
        if self.missing in subject:
            raise NotFoundError
        return RawStreamMsg(subject=subject, headers=SamplerVersion("run", 1).headers())


def test_lookups_are_bounded_and_a_failed_one_is_unstamped_not_an_error():
    import asyncio

    from loopline.tinker_worker.staleness import MAX_LOOKUPS, versions

    rids = {f"{i:032x}_0" for i in range(MAX_LOOKUPS + 500)}  # a hostile body naming too many
    failing, missing = sorted(rids)[:2]
    stream = _Stream(failing, missing)
    found = asyncio.run(versions(stream, rids))  # type: ignore[arg-type]
    assert stream.reads == MAX_LOOKUPS
    assert len(found) == MAX_LOOKUPS - 2 and failing not in found and missing not in found
    assert set(found.values()) == {SamplerVersion("run", 1)}

"""ResultItem bodies: large answers travel compressed and read back the same; stream events keep
their positions."""

from __future__ import annotations

import json

from loopline.common.contracts.schemas import (
    COMPRESS_ABOVE,
    ResultItem,
    parse_stream_event,
    stream_event,
)


def _result(text: str, media_type: str = "application/json") -> ResultItem:
    return ResultItem(request_id="g_000000000", group="g", index=0, model="m", media_type=media_type,
                      **ResultItem.with_body(text))


def test_small_bodies_travel_as_they_are():
    result = _result('{"ok":true}')
    assert result.body == '{"ok":true}' and result.body_zlib is None
    assert result.text() == '{"ok":true}'


def test_large_transcripts_are_compressed_and_read_back_exactly():
    event = 'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"%d é"}]}\n\n'
    transcript = "".join(event % i for i in range(600)) + "data: [DONE]\n\n"
    assert len(transcript) > COMPRESS_ABOVE
    result = _result(transcript, "text/event-stream; charset=utf-8")
    assert result.body == "" and result.body_zlib is not None
    wire = result.model_dump_json()
    assert len(wire) < len(transcript) / 5, "a transcript repeats itself: it should shrink a lot"
    back = ResultItem.model_validate_json(wire)
    assert back.text() == transcript
    events = back.events()
    assert len(events) == 601 and events[-1] == "data: [DONE]\n\n"
    assert json.loads(events[7][len("data: "):])["choices"][0]["text"] == "7 é"


def test_stream_events_carry_their_position():
    seq, data = parse_stream_event(stream_event(12, b'data: {"a":"\\n"}\n\n'))
    assert seq == 12 and data == b'data: {"a":"\\n"}\n\n'

"""The protocol as data: every message round-trips, every request has one reply
type and a handler, tags and error codes are unique, the frame reader
survives split, concatenated, garbage and oversize input, and the slot layout
keeps every part page-aligned."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moed.protocol import errors
from moed.protocol import messages as m
from moed.protocol.framing import HEADER, MAX_FRAME_BYTES, FrameReader, encode, reply_decoder
from moed.protocol.layout import PAGE, round_up, slot_layout

SEGMENT = m.SegmentInfo(
    class_id=1,
    capacity=4,
    part_names=["gate", "up", "down"],
    part_bytes=[4352, 4352, 4352],
    part_off=[0, 32768, 65536],
    part_stride=[8192, 8192, 8192],
    segment_bytes=98304,
)
LAYER = m.LayerInfo(
    layer=1,
    class_id=1,
    parts=[
        m.PartExtent("gate", 0, 123456, 4352, 8, [64, 64, 8]),
        m.PartExtent("down", 1, 9876543210, 4352, 8, [64, 64, 8]),
    ],
)

# Every message type with every field set (and, where it has defaults, once bare).
EXAMPLES: dict[type, list] = {
    m.Hello: [m.Hello(m.PROTOCOL_VERSION, "engine-7"), m.Hello(version=1)],
    m.Ping: [m.Ping()],
    m.OpenModel: [m.OpenModel("/models/qwen3 30b/ü.gguf")],
    m.Acquire: [m.Acquire(3, 12, [0, 5, 127], timeout_s=2.5, release=[41, 42]), m.Acquire(1, 0, [7])],
    m.Release: [m.Release([1, 2, 3], ack=False), m.Release([])],
    m.Prefetch: [m.Prefetch(1, 2, [3, 4], ack=True), m.Prefetch(1, 2, [])],
    m.GetStats: [m.GetStats()],
    m.ListModels: [m.ListModels()],
    m.Error: [m.Error(int(errors.ErrorCode.BUDGET_EXHAUSTED), "no room")],
    m.HelloReply: [m.HelloReply(1, "0.1.0", 4242, 1000, 777)],
    m.Pong: [m.Pong(time_ns=1_700_000_000_000_000_000)],
    m.ModelInfo: [
        m.ModelInfo(
            model_id=2,
            path="/m.gguf",
            files=["/m-1.gguf", "/m-2.gguf"],
            moe_layers=[1, 3],
            n_experts=8,
            n_expert_used=2,
            parts=["gate", "up", "down"],
            layers=[LAYER],
            segments=[SEGMENT],
        )
    ],
    m.Granted: [m.Granted(lease_id=9, class_id=1, slots=[0, 3])],
    m.Released: [m.Released(count=2)],
    m.Prefetched: [m.Prefetched(queued=0)],
}  # StatsReply and ModelsReply: typed rows, generated below like every later type


def tag(t: type) -> str:
    return t.__struct_config__.tag


def sample_value(info: msgspec.inspect.Type):
    """A non-default value of a field type, for types nobody wrote an example of."""
    mi = msgspec.inspect
    if isinstance(info, mi.StructType):
        return sample(info.cls)
    if isinstance(info, mi.UnionType):
        return sample_value(next(t for t in info.types if not isinstance(t, mi.NoneType)))
    if isinstance(info, (mi.ListType, mi.VarTupleType)):
        return [sample_value(info.item_type)] * 2
    if isinstance(info, mi.TupleType):
        return tuple(sample_value(t) for t in info.item_types)
    if isinstance(info, mi.DictType):
        return {sample_value(info.key_type): sample_value(info.value_type)}
    simple = {mi.IntType: 7, mi.FloatType: 1.5, mi.StrType: "s", mi.BoolType: True, mi.AnyType: [1, "a"]}
    return simple[type(info)]


def sample(t: type):
    return t(**{f.name: sample_value(f.type) for f in msgspec.inspect.type_info(t).fields})


# ---- the message set ---------------------------------------------------------------


for _t in m.REQUEST_TYPES + m.REPLY_TYPES:  # types added later get a generated example
    EXAMPLES.setdefault(_t, []).append(sample(_t))


def test_stats_refuse_undeclared_or_missing_keys():
    """The stats contract is the Stats struct: a key the daemon forgets, or adds
    without declaring it, fails the conversion instead of reaching clients."""
    from moed.protocol.stats import CONTRACT_KEYS, Stats

    good = msgspec.to_builtins(sample(Stats))
    assert msgspec.convert(good, Stats) == sample(Stats)
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({**good, "surprise": 1}, Stats)
    with pytest.raises(msgspec.ValidationError, match="budget_bytes"):
        msgspec.convert({k: v for k, v in good.items() if k != "budget_bytes"}, Stats)
    for key in CONTRACT_KEYS:
        assert key in good  # the contract keys (CONTRACT_KEYS)


def test_tags_are_unique_across_requests_and_replies():
    tags = [tag(t) for t in m.REQUEST_TYPES + m.REPLY_TYPES]
    assert len(tags) == len(set(tags))
    assert all(isinstance(t, str) and t for t in tags)


def test_every_request_has_exactly_one_reply_type():
    assert set(m.REPLY_TYPE) == set(m.REQUEST_TYPES)
    replies = list(m.REPLY_TYPE.values())
    assert all(r in m.REPLY_TYPES for r in replies)
    assert len(set(replies)) == len(replies)  # one request per reply type, too
    assert m.Error not in replies  # Error may replace any reply


def test_every_request_has_a_handler():
    from moed.daemon.sessions import Session

    session = Session(daemon=None)  # __init__ only builds the table
    assert set(session._handlers) == set(m.REQUEST_TYPES)
    assert all(callable(h) for h in session._handlers.values())


def test_only_fire_and_forget_requests_skip_the_reply():
    assert m.wants_reply(m.Ping()) and m.wants_reply(m.Acquire(1, 0, [1]))
    assert m.wants_reply(m.Release([1])) and not m.wants_reply(m.Release([1], ack=False))
    assert not m.wants_reply(m.Prefetch(1, 0, [1])) and m.wants_reply(m.Prefetch(1, 0, [1], ack=True))


# ---- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("msg", [x for t in m.REQUEST_TYPES for x in EXAMPLES[t]], ids=repr)
def test_request_round_trips(msg):
    assert FrameReader().feed(encode(msg)) == [msg]


@pytest.mark.parametrize("msg", [x for t in m.REPLY_TYPES for x in EXAMPLES[t]], ids=repr)
def test_reply_round_trips(msg):
    assert FrameReader(reply_decoder).feed(encode(msg)) == [msg]


def test_a_reply_is_not_a_request_and_a_request_is_not_a_reply():
    out = FrameReader().feed(encode(m.Pong(1)))
    assert len(out) == 1 and isinstance(out[0], errors.BadFrame)
    out = FrameReader(reply_decoder).feed(encode(m.Ping()))
    assert len(out) == 1 and isinstance(out[0], errors.BadFrame)


def test_unknown_fields_from_a_newer_peer_are_ignored():
    payload = msgspec.msgpack.encode(
        {"t": "acquire", "model_id": 1, "layer": 2, "experts": [3], "priority": 9, "hint": {"x": [1]}}
    )
    assert FrameReader().feed(HEADER.pack(len(payload)) + payload) == [m.Acquire(1, 2, [3])]


def test_defaults_are_left_off_the_wire():
    bare = msgspec.msgpack.decode(encode(m.Acquire(1, 2, [3]))[HEADER.size :])
    assert bare == {"t": "acquire", "model_id": 1, "layer": 2, "experts": [3]}


# ---- frame reader ------------------------------------------------------------------------


def frames(*msgs) -> bytes:
    return b"".join(encode(x) for x in msgs)


def frame_of(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def test_frames_split_at_every_byte():
    msgs = [m.Hello(1, "x"), m.Acquire(1, 2, [3, 4]), m.Ping(), m.Release([5])]
    data = frames(*msgs)
    r, out = FrameReader(), []
    for i in range(len(data)):
        out += r.feed(data[i : i + 1])
    assert out == msgs


def test_concatenated_frames_in_one_feed_and_a_partial_tail():
    msgs = [m.Ping(), m.GetStats(), m.ListModels()]
    data = frames(*msgs) + encode(m.Ping())[:3]
    r = FrameReader()
    assert r.feed(data) == msgs
    assert r.feed(b"") == []
    assert r.feed(encode(m.Ping())[3:]) == [m.Ping()]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        b"",  # empty frame
        msgspec.msgpack.encode({"t": "no_such_verb"}),
        msgspec.msgpack.encode({"t": "acquire", "model_id": "one", "layer": 0, "experts": []}),
        msgspec.msgpack.encode({"t": "acquire", "model_id": 1}),  # missing fields
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"t": "ping"}) + b"\x00",  # trailing bytes
        b"\x82\xa1t\xa4ping\xa1x" + b"\x91" * 100_000 + b"\x90",  # nested past the recursion limit
    ],
    ids=["reserved", "empty", "unknown-tag", "wrong-type", "missing", "array", "trailing", "deep"],
)
def test_garbage_frame_is_a_bad_frame_and_the_stream_goes_on(payload):
    r = FrameReader()
    out = r.feed(encode(m.Ping()) + frame_of(payload) + encode(m.GetStats()))
    assert out[0] == m.Ping() and out[2] == m.GetStats() and len(out) == 3
    assert isinstance(out[1], errors.BadFrame) and out[1].code == errors.ErrorCode.BAD_FRAME
    assert not r.broken


def test_deeply_nested_reply_is_a_bad_frame_for_the_client_too():
    payload = b"\x82\xa1t\xabstats_reply\xa5stats" + b"\x81\xa1a" * 100_000 + b"\x90"
    out = FrameReader(reply_decoder).feed(frame_of(payload))
    assert len(out) == 1 and isinstance(out[0], errors.BadFrame)


def test_oversize_length_breaks_the_stream_after_the_frames_before_it():
    r = FrameReader()
    out = r.feed(encode(m.Ping()) + HEADER.pack(MAX_FRAME_BYTES + 1) + encode(m.GetStats()))
    assert out[0] == m.Ping() and len(out) == 2
    assert isinstance(out[1], errors.BadFrame) and "exceeds" in str(out[1])
    assert r.broken
    assert r.feed(encode(m.Ping())) == []  # nothing after: the caller closes


def test_oversize_frame_arriving_whole_in_one_read_is_still_refused():
    r = FrameReader()
    out = r.feed(HEADER.pack(MAX_FRAME_BYTES + 1) + b"\x00" * (MAX_FRAME_BYTES + 1))
    assert len(out) == 1 and isinstance(out[0], errors.BadFrame) and r.broken


def test_a_frame_of_exactly_the_limit_is_accepted_and_awaited():
    r = FrameReader()
    assert r.feed(HEADER.pack(MAX_FRAME_BYTES) + b"\x00" * 1000) == []
    assert not r.broken


# ---- errors ---------------------------------------------------------------------------------


def test_error_codes_are_unique_and_each_has_one_exception_type():
    codes = [c.value for c in errors.ErrorCode.__members__.values()]
    assert len(codes) == len(set(codes))  # no IntEnum aliases
    types = [t for t in errors.MoedError.__subclasses__()]
    assert sorted(t.code for t in types) == sorted(codes)
    assert len({t.__name__ for t in types}) == len(types)


def test_retired_codes_are_never_reused():
    assert not set(errors.RETIRED_CODES) & {c.value for c in errors.ErrorCode}
    assert type(errors.error_for(15, "old daemon")) is errors.InternalError


@pytest.mark.parametrize("code", list(errors.ErrorCode), ids=lambda c: c.name)
def test_error_for_rebuilds_the_exception_type(code):
    exc = errors.error_for(int(code), "what went wrong")
    assert type(exc) is not errors.MoedError and isinstance(exc, errors.MoedError)
    assert exc.code == code and exc.message == "what went wrong" and str(exc) == "what went wrong"
    # the same exception survives the wire
    reply = FrameReader(reply_decoder).feed(encode(m.Error(int(exc.code), exc.message)))[0]
    again = errors.error_for(reply.code, reply.message)
    assert type(again) is type(exc) and again.message == exc.message


def test_named_types_and_unknown_codes():
    assert type(errors.error_for(errors.ErrorCode.REQUEST_TOO_LARGE, "")) is errors.RequestTooLarge
    assert type(errors.error_for(errors.ErrorCode.BUDGET_EXHAUSTED, "")) is errors.BudgetExhausted
    assert type(errors.error_for(errors.ErrorCode.BAD_FRAME, "")) is errors.BadFrame
    assert type(errors.error_for(9999, "future")) is errors.InternalError
    assert str(errors.BadRequest()) == "BadRequest"


# ---- fuzz ---------------------------------------------------------------------------------------


def check_output(out):
    for x in out:
        assert isinstance(x, (m.Message, errors.BadFrame))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=6))
def test_random_bytes_never_raise(data, cuts):
    r = FrameReader()
    pos = 0
    for cut in sorted(cuts) + [len(data)]:
        check_output(r.feed(data[pos:cut]))
        pos = max(pos, cut)


MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
FIELD_NAMES = st.sampled_from(
    [
        "t",
        "version",
        "model_id",
        "layer",
        "experts",
        "lease_ids",
        "ack",
        "timeout_s",
        "release",
        "path",
        "stats",
        "models",
        "code",
        "x",
    ]
)
TAGS = st.sampled_from([tag(t) for t in EXAMPLES] + ["", "nope"])


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(FIELD_NAMES, MSGPACK_VALUES, max_size=5), TAGS, st.booleans())
def test_random_well_framed_messages_never_raise(fields, t, reply_side):
    fields["t"] = t
    payload = msgspec.msgpack.encode(fields)
    r = FrameReader(reply_decoder) if reply_side else FrameReader()
    out = r.feed(frame_of(payload) + encode(m.Ping() if not reply_side else m.Pong(1)))
    check_output(out)
    assert len(out) == 2 and isinstance(out[1], (m.Ping, m.Pong))


# ---- slot layout -------------------------------------------------------------------------------


def test_round_up():
    assert [round_up(n) for n in (0, 1, PAGE - 1, PAGE, PAGE + 1)] == [0, PAGE, PAGE, PAGE, 2 * PAGE]
    assert round_up(5, 4) == 8 and round_up(8, 4) == 8


def test_slot_layout_by_hand():
    # gate/up 4352 bytes (2 pages), down 8192 (2 pages exactly), 3 slots
    offs, strides, total = slot_layout([4352, 4352, 8192], 3)
    assert strides == [8192, 8192, 8192]
    assert offs == [0, 3 * 8192, 6 * 8192] and total == 9 * 8192


@given(st.lists(st.integers(1, 3 * PAGE), min_size=1, max_size=4), st.integers(1, 20))
def test_slot_layout_parts_are_page_aligned_and_disjoint(part_bytes, capacity):
    offs, strides, total = slot_layout(part_bytes, capacity)
    spans = []
    for b, off, stride in zip(part_bytes, offs, strides):
        assert off % PAGE == 0 and stride % PAGE == 0 and b <= stride < b + PAGE
        spans += [(off + i * stride, off + i * stride + b) for i in range(capacity)]
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= total == sum(s * capacity for s in strides)

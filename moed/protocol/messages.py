"""The protocol as data: one tagged msgspec Struct per request, exactly one reply type.

Rules kept here (docs/design.md, "Protocol and how it evolves"):
- fields are only ever appended, always with defaults, so old peers still decode;
- a tag is never reused;
- `REPLY_TYPE` maps every request type to its single reply type (an `Error`
  may replace any reply);
- requests with `ack=False` get no reply at all, not even an `Error`: the client
  does not wait for them, so a reply would desynchronise the stream.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from .stats import ModelRow, Stats

PROTOCOL_VERSION = 1

# Bounds checked while decoding, so no request can make the daemon build a
# large object before a handler looks at it (a hostile frame is rejected as
# BAD_FRAME at the edge). The largest real uses: a layer's experts (<= 512 in
# every public MoE), every expert of a big model pinned at once (94 x 512).
MAX_IDS = 4096
MAX_PIN_PAIRS = 1 << 18
MAX_PATH_CHARS = 4096
MAX_NAME_CHARS = 256
MAX_COMPUTE_CHARS = 256  # an engine's "what computes where" (OpenModel.compute)

Ids = Annotated[list[int], msgspec.Meta(max_length=MAX_IDS)]
Pairs = Annotated[list[tuple[int, int]], msgspec.Meta(max_length=MAX_PIN_PAIRS)]


class Message(msgspec.Struct, tag_field="t", array_like=False, omit_defaults=True):
    pass


# ---- requests -----------------------------------------------------------


class Hello(Message, tag="hello"):
    version: int
    client_name: Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)] = ""


class Ping(Message, tag="ping"):
    pass


class OpenModel(Message, tag="open_model"):
    path: Annotated[str, msgspec.Meta(max_length=MAX_PATH_CHARS)]
    # The expert layout the engine will compute on ("plain", "q4_0_8x8", ...; see
    # moed.gguf.layouts); "" takes the file as it is. A plain file asked for a repacked
    # layout is made in it on read (moed.daemon.onread); what the daemon can neither find
    # nor make is LayoutUnavailable.
    expert_layout: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # What computes where in the engine that opens it ("experts CPU; layers 12-23, output
    # on Vulkan0"): shown per connection by `moectl stats`; "" for clients that compute nothing.
    compute: Annotated[str, msgspec.Meta(max_length=MAX_COMPUTE_CHARS)] = ""


class Acquire(Message, tag="acquire"):
    """Hold `experts` of `layer` until released (a lease); `release` piggybacks earlier leases."""

    model_id: int
    layer: int
    experts: Ids
    timeout_s: float | None = None
    release: Ids = []


class Release(Message, tag="release"):
    lease_ids: Ids
    ack: bool = True


class Prefetch(Message, tag="prefetch"):
    model_id: int
    layer: int
    experts: Ids
    ack: bool = False


class MapHolds(Message, tag="map_holds"):
    """Ask for this connection's hold region (one writable descriptor comes with the reply)."""


class GetStats(Message, tag="stats"):
    pass


class ListModels(Message, tag="models"):
    pass


# ---- replies ------------------------------------------------------------


class Error(Message, tag="error"):
    code: int
    message: str
    # what the error's type carries besides the message (errors.MoedError.DETAIL), e.g. a
    # ReadError's model, layer, expert, part and errno
    detail: Annotated[dict[str, int | str], msgspec.Meta(max_length=16)] = {}


class HelloReply(Message, tag="hello_reply"):
    version: int
    daemon_version: str
    daemon_pid: int
    peer_uid: int
    peer_pid: int


class Pong(Message, tag="pong"):
    time_ns: int


class PartExtent(msgspec.Struct, array_like=True):
    """Where one part (gate/up/down/gate_up) of one layer's experts lives in the file."""

    part: str
    shard: int  # index into ModelInfo.files
    offset: int  # absolute file offset of expert 0
    bytes_per_expert: int
    ggml_type: int
    shape: list[int]  # the tensor's GGUF shape (ne0, ne1, n_expert)


class LayerInfo(msgspec.Struct, array_like=True):
    layer: int
    class_id: int
    parts: list[PartExtent]


class SegmentInfo(msgspec.Struct):
    """One shared-memory segment: the slots of one size class.

    Part `k` of slot `i` is at `part_off[k] + i * part_stride[k]` and is
    `part_bytes[k]` long; every `part_off` and `part_stride` is page-aligned.
    The file descriptor travels beside the reply (SCM_RIGHTS), in the order of
    `ModelInfo.segments`, opened read-only.
    """

    class_id: int
    capacity: int
    part_names: list[str]
    part_bytes: list[int]
    part_off: list[int]
    part_stride: list[int]
    segment_bytes: int


class ModelInfo(Message, tag="model_info"):
    model_id: int
    path: str
    files: list[str]
    moe_layers: list[int]
    n_experts: int
    n_expert_used: int
    parts: list[str]
    layers: list[LayerInfo]
    segments: list[SegmentInfo]
    # True: after the segments' descriptors come each segment's slot-state words
    # (same order) and then the model's residency table (moed.protocol.residency_words).
    residency: bool = False
    expert_layout: str = "plain"  # the layout its experts are served in: the file's, or made on read


class Granted(Message, tag="granted"):
    """The lease: slot `slots[j]` of segment `class_id` holds `experts[j]`."""

    lease_id: int
    class_id: int
    slots: list[int]


class Released(Message, tag="released"):
    count: int


class HoldsMapped(Message, tag="holds_mapped"):
    region_words: int  # the region's size in uint64 words (layout: moed.protocol.residency_words)


class Prefetched(Message, tag="prefetched"):
    queued: int


class StatsReply(Message, tag="stats_reply"):
    stats: Stats


class ModelsReply(Message, tag="models_reply"):
    models: list[ModelRow]


# ---- control (operator) requests: the peer must be root or the daemon's uid ----


class SetMemFloor(Message, tag="set_mem_floor"):
    """Change the memory guard's floor live (0 turns the guard off)."""

    floor_bytes: int


class MemFloorSet(Message, tag="mem_floor_set"):
    floor_bytes: int
    effective_budget_bytes: int
    mem_available_bytes: int
    given_back_bytes: int


class Pin(Message, tag="pin"):
    """Pin experts of an open model into the pinned partition (the host mirror).

    `experts` are (layer, expert) pairs, hottest first; they are pinned in
    order until the pin budget is full. `all` pins every expert, and so does
    any request on a model whose experts all fit in the free pin budget.
    `from_stats` takes the order from the daemon's own decayed access counts.
    The reply comes once the pinned experts are read in.
    """

    model_id: int
    experts: Pairs = []
    all: bool = False
    from_stats: bool = False


class Pinned(Message, tag="pinned"):
    pinned: int  # experts newly pinned by this request
    skipped: int  # asked for but not pinned (no pin budget left)
    pinned_bytes: int  # the whole pinned partition now


class Unpin(Message, tag="unpin"):
    """Unpin experts (or `all` of the model's); they rejoin the shared LRU or are dropped."""

    model_id: int
    experts: Pairs = []
    all: bool = False


class Unpinned(Message, tag="unpinned"):
    unpinned: int
    pinned_bytes: int


class ClearReadErrors(Message, tag="clear_read_errors"):
    """End the quarantine of experts whose reads failed, so the next acquire reads them
    again: those of one open model, or (`model_id` 0) of every model."""

    model_id: int = 0


class ReadErrorsCleared(Message, tag="read_errors_cleared"):
    cleared: int  # quarantined experts released


# ---- compute turns (docs/design.md §11, "Cores shared by the engines"; moed.daemon.turns) ----

MAX_THREADS = 1 << 16  # far above any core count; an engine's larger count is sent as this
Threads = Annotated[int, msgspec.Meta(ge=0, le=MAX_THREADS)]


class TakeTurn(Message, tag="take_turn"):
    """Ask for a compute turn for one decode; the reply comes when it is granted (at most
    about the daemon's `turn_max_s` later). `threads`, `threads_batch`: the engine's own
    counts, 0 where the daemon decides; `cpus`: the cores the engine may run on; `batch`:
    the decode computes more than one token (llama.cpp computes it with threads_batch)."""

    threads: Threads = 0
    threads_batch: Threads = 0
    cpus: Annotated[int, msgspec.Meta(ge=1, le=MAX_THREADS)] = 1
    batch: bool = False


class EndTurn(Message, tag="end_turn"):
    """Let the turn go after the decode: fire and forget (sent only after a TurnGranted,
    so a daemon without the verb never sees it)."""

    ack: bool = False


class TurnGranted(Message, tag="turn_granted"):
    """Compute now with these counts (the engine's own where it gave them)."""

    n_threads: int
    n_threads_batch: int
    waited_s: float = 0.0


class TurnEnded(Message, tag="turn_ended"):
    """EndTurn's reply, sent only when it asked for one (`ack=True`)."""


# ---- what an engine's device does (docs/design.md §9.2 "Seeing it", §11) ----

Count = Annotated[int, msgspec.Meta(ge=0)]


class DeviceReport(Message, tag="device_report"):
    """An engine's device slots for one model it opened on this connection: its own counters
    since it started (totals, so a report replaces the last: none is ever added twice), sent
    fire and forget at the end of an eval at most about once a second and when it closes.
    The daemon keeps the latest per (connection, model) and shows it in `moectl stats`."""

    model_id: int
    slots: Count = 0  # device slots a layer (S, as recorded: at most the model's experts)
    layers: Count = 0  # layers whose experts compute in the device slots
    hits: Count = 0  # (layer, expert) a batch used that a device slot already held
    uploads: Count = 0  # experts copied into a device slot
    upload_bytes: Count = 0
    evictions: Count = 0  # device slots given to another expert
    zero_copy: bool = False  # the device reads moed's RAM tier in place (nothing uploaded)
    ack: bool = False


class DeviceReported(Message, tag="device_reported"):
    """DeviceReport's reply, sent only when it asked for one (`ack=True`)."""


Request = (
    Hello
    | Ping
    | OpenModel
    | Acquire
    | Release
    | Prefetch
    | GetStats
    | ListModels
    | SetMemFloor
    | Pin
    | Unpin
    | MapHolds
    | ClearReadErrors
    | TakeTurn
    | EndTurn
    | DeviceReport
)
Reply = (
    Error
    | HelloReply
    | Pong
    | ModelInfo
    | Granted
    | Released
    | Prefetched
    | StatsReply
    | ModelsReply
    | MemFloorSet
    | Pinned
    | Unpinned
    | HoldsMapped
    | ReadErrorsCleared
    | TurnGranted
    | TurnEnded
    | DeviceReported
)

REPLY_TYPE: dict[type, type] = {
    Hello: HelloReply,
    Ping: Pong,
    OpenModel: ModelInfo,
    Acquire: Granted,
    Release: Released,
    Prefetch: Prefetched,
    GetStats: StatsReply,
    ListModels: ModelsReply,
    SetMemFloor: MemFloorSet,
    Pin: Pinned,
    Unpin: Unpinned,
    MapHolds: HoldsMapped,
    ClearReadErrors: ReadErrorsCleared,
    TakeTurn: TurnGranted,
    EndTurn: TurnEnded,
    DeviceReport: DeviceReported,
}

REQUEST_TYPES: tuple[type, ...] = Request.__args__
REPLY_TYPES: tuple[type, ...] = Reply.__args__


def wants_reply(request: Message) -> bool:
    """False for fire-and-forget requests (`ack=False`)."""
    return getattr(request, "ack", True)


__all__ = [
    "PROTOCOL_VERSION",
    "Message",
    "Request",
    "Reply",
    "REPLY_TYPE",
    "REQUEST_TYPES",
    "REPLY_TYPES",
    "wants_reply",
    "PartExtent",
    "LayerInfo",
    "SegmentInfo",
    "MAX_THREADS",
] + [t.__name__ for t in REQUEST_TYPES + REPLY_TYPES]

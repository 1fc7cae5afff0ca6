"""The peer channel's headers, typed: one model per request (``put``, ``held``, ``get``, ``list``, ``jobs``) and per
answer, each field bounded, parsed from the JSON object the channel authenticated (docs/multihost.md, "Peer
copies").

Why a module of its own: a header is hostile until checked, wherever it is read. ``_protocol`` frames and
authenticates a JSON object and knows nothing of what it says; here that object becomes a request or an answer
or ``PeerError``, so the listener (``_server``) and the caller (``_requests``) only ever hold a checked model,
as ckptd's boundary with its persist worker does (its typed requests and answers). The JSON is what the channel
has always carried (each model's ``wire()``), so the magic line stays ``CKPTDP2``.

The bounds: a job is one valid job name; a host index is below the job's host count, which is 2 to
``MAX_HOSTS``; a step is at most ``MAX_STEP``; a part's ``snapshot.json`` is at most the snapshot format's
``MAX_META_BYTES`` and its data at most ``MAX_PART_BYTES`` (the room on the receiving host bounds it first);
a request names at most ``MAX_HELD`` steps held and an answer at most ``MAX_JOBS_LISTED`` jobs. Integers are
JSON integers (``true`` or ``1.0`` is no host), and a field a model does not have is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from ckptd.peers._protocol import Channel, PeerError
from trainer_client.core.format import MAX_META_BYTES
from trainer_client.core.protocol import MAX_HOSTS, SAVE_ID_PATTERN, is_valid_job_name

MAX_STEP = 2**63 - 1  # a step of the memory tier's directory names (19 digits)
MAX_PART_BYTES = 1 << 44  # a part's data.bin at most (16 TiB); the room on this host bounds it first
MAX_HELD = 4096  # steps named held in one request, and copies listed in one answer
MAX_JOBS_LISTED = 256  # jobs named in one answer to ``jobs``
MAX_ERROR_CHARS = 500  # of a refusal's reason
MAX_INSTANCE_CHARS = 64  # a listener's instance id (``PeerListener.instance``: 32 hex digits)


def _job_name(job: str) -> str:
    if not is_valid_job_name(job):
        raise ValueError("not a job name")
    return job


JobName = Annotated[str, AfterValidator(_job_name)]
Host = Annotated[int, Field(ge=0, lt=MAX_HOSTS)]
HostCount = Annotated[int, Field(ge=2, le=MAX_HOSTS)]
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Instance = Annotated[str, Field(max_length=MAX_INSTANCE_CHARS)]
SaveId = Annotated[str, Field(pattern=SAVE_ID_PATTERN)]


def _pair(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value  # JSON has arrays, no tuples


Listed = Annotated[tuple[Step, SaveId | None], BeforeValidator(_pair)]  # a copy listed: [step, save id]


class Header(BaseModel):
    """A header of the channel: strict (JSON's own types), no field the model does not have, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def wire(self) -> dict[str, Any]:
        """The JSON object sent (every field, ``None`` as ``null``: what the channel always carried)."""
        return self.model_dump(mode="json")


class _OfHost(Header):
    """About host ``origin``'s part of a save of ``count`` hosts."""

    origin: Host
    count: HostCount

    @model_validator(mode="after")
    def _origin_among_the_hosts(self) -> _OfHost:
        if self.origin >= self.count:
            raise ValueError(f"host {self.origin} is not one of {self.count} hosts")
        return self


class _OfJob(_OfHost):
    job: JobName


class PutRequest(_OfJob):
    """The origin offers its part of ``step``: ``meta`` bytes of ``snapshot.json`` and ``data`` bytes follow once
    the holder says it has not got it; ``held``: the steps the origin still holds (the others' copies go)."""

    op: Literal["put"] = "put"
    step: Step
    held: list[Step] = Field(max_length=MAX_HELD)
    meta: int = Field(ge=1, le=MAX_META_BYTES)
    data: int = Field(ge=0, le=MAX_PART_BYTES)
    sender: Instance = ""  # the sender's own listener's instance: a listener refuses a copy from itself


class HeldRequest(_OfJob):
    """The origin holds the steps ``held`` only: the holder drops its copies of the others."""

    op: Literal["held"] = "held"
    held: list[Step] = Field(max_length=MAX_HELD)
    sender: Instance = ""


class GetRequest(_OfJob):
    """The origin asks for the copy of its part of ``step`` back (of that save, when ``save_id``)."""

    op: Literal["get"] = "get"
    step: Step
    save_id: SaveId | None = None


class ListRequest(_OfJob):
    """Which copies of the origin's part the holder keeps."""

    op: Literal["list"] = "list"


class JobsRequest(_OfHost):
    """The jobs of which the holder keeps copies of host ``origin``'s part of a ``count``-host save (a sidecar on
    a new node asks: it knows no job yet)."""

    op: Literal["jobs"] = "jobs"


PeerRequest = Annotated[PutRequest | HeldRequest | GetRequest | ListRequest | JobsRequest, Field(discriminator="op")]
_REQUEST: TypeAdapter[PeerRequest] = TypeAdapter(PeerRequest)
OPERATIONS = ("put", "held", "get", "list", "jobs")


class Refusal(Header):
    """The listener's refusal: the request ends here (``busy`` when all its request slots are taken)."""

    ok: Literal[False] = False
    error: str = Field(default="refused")

    @classmethod
    def of(cls, why: object) -> Refusal:
        return cls(error=str(why)[:MAX_ERROR_CHARS])


class Done(Header):
    """Done, nothing to tell (a copy received and checked)."""

    ok: Literal[True] = True


class PutAnswer(Header):
    """To a ``put``: whether the holder keeps that copy already (``have``: send nothing), and who it is."""

    ok: Literal[True] = True
    have: bool
    holder: Instance


class HeldAnswer(Header):
    """To a ``held``: how many copies were dropped, and who the holder is."""

    ok: Literal[True] = True
    dropped: int = Field(ge=0)
    holder: Instance


class GetAnswer(Header):
    """To a ``get``: the sizes of the part's ``snapshot.json`` and data, which follow as two bodies."""

    ok: Literal[True] = True
    meta: int = Field(ge=1, le=MAX_META_BYTES)
    data: int = Field(ge=0, le=MAX_PART_BYTES)


class ListAnswer(Header):
    """To a ``list``: ``[step, save id]`` of every intact copy of the origin's part, oldest first."""

    ok: Literal[True] = True
    copies: list[Listed] = Field(max_length=MAX_HELD)


class JobsAnswer(Header):
    """To a ``jobs``: the jobs (by name) of which intact copies of the host's part are kept."""

    ok: Literal[True] = True
    jobs: list[JobName] = Field(max_length=MAX_JOBS_LISTED)


_H = TypeVar("_H", bound=Header)


def _why(exc: ValidationError) -> str:
    """The first problem of ``exc``, by field: never the value sent (it may be anything, of any size)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "the header"
    if first["type"] == "union_tag_invalid":
        return f"no such operation (one of {', '.join(OPERATIONS)})"
    if first["type"] == "union_tag_not_found":
        return "no operation named (op)"
    return f"{where}: {first['msg']}"[:200]


def parse_request(header: dict[str, Any]) -> PeerRequest:
    """The request ``header`` is (the channel authenticated it); ``PeerError`` naming what is wrong otherwise."""
    try:
        return _REQUEST.validate_python(header)
    except ValidationError as exc:
        raise PeerError(f"a request refused: {_why(exc)}") from None


def parse_answer(header: dict[str, Any], answer: type[_H]) -> _H:
    """The ``answer`` ``header`` is; ``PeerError`` with the listener's reason when it refused (``ok`` not true), or
    naming what is wrong when it is not that answer."""
    try:
        if header.get("ok") is not True:
            raise PeerError(Refusal.model_validate(header).error[:MAX_ERROR_CHARS])
        return answer.model_validate(header)
    except ValidationError as exc:
        raise PeerError(f"an answer refused: {_why(exc)}") from None


def send(chan: Channel, header: Header) -> None:
    """``header`` on ``chan`` (its JSON object, tagged)."""
    chan.send_header(header.wire())


def receive_request(chan: Channel) -> PeerRequest:
    """The request the caller sent on ``chan``, checked (``PeerError`` otherwise)."""
    return parse_request(chan.recv_header())


def expect(chan: Channel, answer: type[_H]) -> _H:
    """The listener's ``answer`` on ``chan``, checked; ``PeerError`` with its reason when it refused."""
    return parse_answer(chan.recv_header(), answer)


__all__ = [
    "MAX_HELD",
    "MAX_JOBS_LISTED",
    "MAX_PART_BYTES",
    "MAX_STEP",
    "Done",
    "GetAnswer",
    "GetRequest",
    "Header",
    "HeldAnswer",
    "HeldRequest",
    "JobsAnswer",
    "JobsRequest",
    "ListAnswer",
    "ListRequest",
    "PeerRequest",
    "PutAnswer",
    "PutRequest",
    "Refusal",
    "expect",
    "parse_answer",
    "parse_request",
    "receive_request",
    "send",
]

"""How fresh an answer must be, as a request says it: the headers proxies and nodes both read.

- `x-kroute-max-lag: N`, `x-kroute-max-lag-ms: N`: lag budgets (offsets behind the partition's
  end, and milliseconds since the store was last known caught up).
- `x-kroute-min-offset`: read-your-writes. Either a record offset, `<offset>` (what a producer's
  acknowledgement gives), bounding the key's partition; or a position token,
  `<partition>:<offset>[,<partition>:<offset>...]`, of which only the key's partition's entry
  counts (several for one partition: the highest). Either way the answer must come from a
  store that has applied that offset: its position (the next offset it will read) is past it.
  Offsets are Kafka Streams' Position offsets (PositionBound.at, KAFKA-13522): the offset of
  the last record applied, so a producer's offset is used as it is.
- `x-kroute-position: <partition>:<offset>`, on every lookup answer of a node (200, 404 and
  its 421s): the last offset the store had applied when it answered (-1: none). Sent back as
  `x-kroute-min-offset`, it asks for an answer at least as fresh (monotonic reads); tokens of
  several answers merge by joining them with commas (ksqlDB's consistency vector).
- `x-kroute-refused`, on a node's 421 for a request whose bounds it cannot meet: why, in the
  words the proxy uses for its own refusals (`lag 40 over budget 10`). A proxy then asks the
  next replica without re-reading its table (the table is not wrong about placement).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

MAX_LAG_HEADER = "x-kroute-max-lag"
MAX_LAG_MS_HEADER = "x-kroute-max-lag-ms"
MIN_OFFSET_HEADER = "x-kroute-min-offset"
POSITION_HEADER = "x-kroute-position"
REFUSED_HEADER = "x-kroute-refused"

_MAX_DIGITS = 18  # below 2**63: any Kafka offset, never an overflow in C or Redis
_MAX_PARTITION = 2**31 - 1


class BadFreshnessHeader(ValueError):
    """A freshness header's value is malformed; the message says what is wrong (a 400)."""

    def __init__(self, header: str, value: str, detail: str) -> None:
        super().__init__(f"{header} {detail}")
        self.header, self.value, self.detail = header, value, detail


def parse_count(raw: str, header: str) -> int:
    """A budget: a non-negative decimal integer."""
    text = raw.strip()
    if not text.isdigit() or len(text) > _MAX_DIGITS:
        raise BadFreshnessHeader(header, raw, "must be a non-negative integer")
    return int(text)


@dataclass(frozen=True, slots=True)
class MinOffsets:
    """A parsed x-kroute-min-offset: a bare offset (any partition) or per-partition offsets."""

    bare: int | None = None
    by_partition: Mapping[int, int] = field(default_factory=dict)

    def for_partition(self, partition: int) -> int | None:
        """The lowest record offset the store of `partition` must have applied; None: no bound."""
        return self.bare if self.bare is not None else self.by_partition.get(partition)


def parse_min_offsets(raw: str) -> MinOffsets:
    text = raw.strip()
    if ":" not in text:
        return MinOffsets(bare=_offset(text, raw))
    by_partition: dict[int, int] = {}
    for entry in text.split(","):
        partition_text, colon, offset_text = entry.strip().partition(":")
        if not colon:
            raise _bad_min_offset(raw, f"entry {entry.strip()!r} is not <partition>:<offset>")
        partition = partition_text.strip()
        if not partition.isdigit() or int(partition) > _MAX_PARTITION:
            raise _bad_min_offset(raw, f"partition {partition!r} is not a partition number")
        offset = _offset(offset_text.strip(), raw)
        by_partition[int(partition)] = max(offset, by_partition.get(int(partition), offset))
    return MinOffsets(by_partition=by_partition)


def _offset(text: str, raw: str) -> int:
    digits = text[1:] if text.startswith("-") else text
    if not digits.isdigit() or len(digits) > _MAX_DIGITS or int(text) < -1:
        raise _bad_min_offset(raw, f"offset {text!r} is not an integer >= -1")
    return int(text)


def _bad_min_offset(raw: str, detail: str) -> BadFreshnessHeader:
    return BadFreshnessHeader(
        MIN_OFFSET_HEADER,
        raw,
        f"must be a record offset or <partition>:<offset>[,...] position token: {detail}",
    )


def reached(position: int, min_offset: int) -> bool:
    """Whether a store at `position` (the next offset it reads) has applied `min_offset`."""
    return position > min_offset


def position_token(partition: int, position: int) -> str:
    """The x-kroute-position value of a store at `position` (the next offset it reads)."""
    return f"{partition}:{position - 1}"


def parse_position_token(raw: str) -> tuple[int, int] | None:
    """(partition, last applied offset) of one x-kroute-position value; None if malformed."""
    try:
        parsed = parse_min_offsets(raw)
    except BadFreshnessHeader:
        return None
    if len(parsed.by_partition) != 1:
        return None
    [(partition, offset)] = parsed.by_partition.items()
    return partition, offset

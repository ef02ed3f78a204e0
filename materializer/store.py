"""The node's persistent key-value store: RocksDB (rocksdict), one column family per partition.

Each partition's rows and its checkpoint (the next offset to read, the newest record time) are
written in one atomic RocksDB write batch, so after any crash the store holds exactly the
records below its checkpoint: a restart resumes from there, and a record at or below the
checkpoint is never applied twice. Values live on disk; Python holds only handles.

Layout of one store directory:
- column family `p<N>`: Kafka key bytes -> 16-byte header (record offset, record time in ms,
  big-endian int64s) + the value bytes;
- column family `checkpoints`: b"<N>" -> 24 bytes (next offset, newest record time ms,
  updated at ms).

RocksDB writes hold Python's GIL for their whole duration (~0.3 µs per record, measured), so
the caller bounds the records per write (see `max_records_per_partition` in the settings).
"""

from __future__ import annotations

import shutil
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from rocksdict import ColumnFamily, Options, Rdict, WriteBatch, WriteOptions

from common.clock import now_ms
from materializer.errors import StoreCorrupted, StoreError, first_line

_VALUE_HEADER = struct.Struct(">qq")  # record offset, record timestamp (ms)
_CHECKPOINT = struct.Struct(">qqq")  # next offset, newest record time (ms), updated at (ms)
_CHECKPOINTS_CF = "checkpoints"
_NO_TIME = -1

#: merge(previous stored value or None, new value or None) -> value to store, None deletes.
Merge = Callable[[bytes | None, bytes | None], bytes | None]


def replace_value(_previous: bytes | None, new: bytes | None) -> bytes | None:
    """The KTable merge: the newer record wins; a null value deletes the key."""
    return new


def _partition_cf(partition: int) -> str:
    return f"p{partition}"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    next_offset: int
    newest_record_ms: int | None
    updated_at_ms: int


@dataclass(frozen=True, slots=True)
class StoredValue:
    value: bytes
    offset: int
    timestamp_ms: int | None


@dataclass(frozen=True, slots=True)
class Row:
    """One change to apply: `value` None deletes `key`."""

    key: bytes
    value: bytes | None
    offset: int
    timestamp_ms: int | None


@dataclass(frozen=True, slots=True)
class ApplyResult:
    written: int
    skipped_already_applied: int
    checkpoint: Checkpoint
    merge_failures: list[tuple[int, str]] = field(default_factory=list)  # (offset, why)


class MergeBroken(RuntimeError):
    """The merge hook raised on every row of a sizeable batch: it is broken, not the data.
    Skipping all would empty the store silently; failing the batch stalls the partition
    visibly (not ready, with this reason) until the hook is fixed."""


# A merge that fails on every row of a batch at least this big is broken (MergeBroken).
MERGE_BROKEN_AFTER = 10


log = structlog.get_logger("kroute.materializer.store")


def open_or_rebuild(path: Path) -> Store:
    """Open the store; if RocksDB says its files are damaged, start it empty.

    Everything in the store is derived from Kafka, so a damaged store costs a re-read, never
    data: the checkpoints go with it and the pipeline reads its partitions from the start
    (what Kafka Streams does with a corrupted task). The damaged copy is kept beside it, one
    at a time, for a post-mortem. Any other failure (the lock held by another process, no
    permission) stops the node: wiping would not help and could hide a second node."""
    try:
        return Store(path)
    except StoreCorrupted as exc:
        aside = path.with_name(f"{path.name}.corrupted")
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        log.error(
            "store damaged: moved aside, rebuilding it from Kafka",
            error=str(exc),
            moved_to=str(aside),
        )
        return Store(path)


def _synced() -> WriteOptions:
    options = WriteOptions()
    options.sync = True
    return options


def _raw_options() -> Options:
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    return options


class Store:
    """One store directory. Thread-safe: lookups run beside the writer thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        try:
            existing = Rdict.list_cf(str(path), Options(raw_mode=True))
        except Exception:  # noqa: BLE001 - rocksdict raises a bare Exception for "no database yet"
            existing = ["default"]
        column_families = {name: Options(raw_mode=True) for name in existing if name != "default"}
        try:
            self._db = Rdict(str(path), _raw_options(), column_families=column_families)
        except Exception as exc:
            problem = StoreCorrupted if "Corruption" in str(exc) else StoreError
            raise problem(f"cannot open the store at {path}: {exc}") from exc
        if _CHECKPOINTS_CF not in existing:
            self._db.create_column_family(_CHECKPOINTS_CF, Options(raw_mode=True))
        self._checkpoints = self._db.get_column_family(_CHECKPOINTS_CF)
        self._checkpoints_handle = self._db.get_column_family_handle(_CHECKPOINTS_CF)
        # Column family handles by partition; replaced (never mutated) so readers see one view.
        self._partitions: dict[int, tuple[Rdict, ColumnFamily]] = {
            int(name[1:]): self._open_cf(name)
            for name in existing
            if name.startswith("p") and name[1:].isdigit()
        }
        self._write_lock = threading.Lock()
        self._reconcile()

    def _reconcile(self) -> None:
        """Make partitions and checkpoints agree after a crash inside `drop_partition` (or a
        store written before it was ordered): a checkpoint whose rows are gone would make an
        empty partition look applied up to it (404s with lag 0), and rows without a
        checkpoint are re-read from the log start anyway, so they are dropped with it."""
        for key in list(self._checkpoints.keys()):
            assert isinstance(key, bytes)  # raw mode
            if not key.isdigit() or int(key) not in self._partitions:
                log.warning("checkpoint without its partition's rows: removed", partition=key)
                self._checkpoints.delete(key, _synced())
        for partition in sorted(self._partitions):
            rows = self._partitions[partition][0]
            if self.checkpoint(partition) is None and next(iter(rows.keys()), None) is not None:
                log.warning("rows without a checkpoint: dropped", partition=partition)
                del rows
                self._partitions = {p: h for p, h in self._partitions.items() if p != partition}
                self._db.drop_column_family(_partition_cf(partition))

    def _open_cf(self, name: str) -> tuple[Rdict, ColumnFamily]:
        return self._db.get_column_family(name), self._db.get_column_family_handle(name)

    # -- partitions -------------------------------------------------------------------------

    def partitions(self) -> frozenset[int]:
        return frozenset(self._partitions)

    def add_partition(self, partition: int) -> None:
        with self._write_lock:
            if partition in self._partitions:
                return
            name = _partition_cf(partition)
            self._db.create_column_family(name, Options(raw_mode=True))
            self._partitions = {**self._partitions, partition: self._open_cf(name)}

    def drop_partition(self, partition: int) -> None:
        """Forget a partition entirely: its rows and its checkpoint."""
        with self._write_lock:
            if partition not in self._partitions:
                return
            remaining = dict(self._partitions)
            del remaining[partition]
            self._partitions = remaining
            # The checkpoint goes first, synced: a crash before the rows are dropped leaves
            # rows without a checkpoint, which `_reconcile` drops on open (never the reverse,
            # an empty partition "applied up to N").
            self._checkpoints.delete(str(partition).encode(), _synced())
            self._db.drop_column_family(_partition_cf(partition))

    # -- reads -------------------------------------------------------------------------------

    def checkpoint(self, partition: int) -> Checkpoint | None:
        raw = self._checkpoints.get(str(partition).encode())
        if raw is None:
            return None
        next_offset, newest, updated = _CHECKPOINT.unpack(raw)
        return Checkpoint(next_offset, None if newest == _NO_TIME else newest, updated)

    def checkpoints(self) -> dict[int, Checkpoint | None]:
        return {partition: self.checkpoint(partition) for partition in sorted(self._partitions)}

    def get(self, partition: int, key: bytes) -> StoredValue | None:
        try:
            column_family = self._partitions[partition][0]
        except KeyError:
            raise StoreError(f"partition {partition} is not in this store") from None
        raw = column_family.get(key)
        if raw is None:
            return None
        offset, timestamp = _VALUE_HEADER.unpack_from(raw)
        return StoredValue(
            raw[_VALUE_HEADER.size :], offset, None if timestamp == _NO_TIME else timestamp
        )

    def items(self, partition: int) -> Iterable[tuple[bytes, StoredValue]]:
        """Every key of a partition with its value (tests and repair tools; not the hot path)."""
        column_family = self._partitions[partition][0]
        for key, raw in column_family.items():
            assert isinstance(key, bytes)  # raw mode stores bytes
            assert isinstance(raw, bytes)
            offset, timestamp = _VALUE_HEADER.unpack_from(raw)
            yield (
                key,
                StoredValue(
                    raw[_VALUE_HEADER.size :], offset, None if timestamp == _NO_TIME else timestamp
                ),
            )

    # -- writes ------------------------------------------------------------------------------

    def apply(
        self,
        partition: int,
        rows: Iterable[Row],
        next_offset: int,
        newest_record_ms: int | None,
        merge: Merge = replace_value,
    ) -> ApplyResult:
        """Apply rows (in offset order) and move the checkpoint to `next_offset`, atomically.

        Rows whose offset is below the current checkpoint were applied before and are skipped;
        a batch that ends at or below the checkpoint changes nothing.
        """
        with self._write_lock:
            try:
                column_family, handle = self._partitions[partition]
            except KeyError:
                raise StoreError(f"partition {partition} is not in this store") from None
            current = self.checkpoint(partition)
            applied_up_to = current.next_offset if current else 0
            if current is not None and next_offset <= applied_up_to:
                return ApplyResult(0, 0, current)

            batch = WriteBatch(raw_mode=True)
            pending: dict[bytes, bytes | None] = {}  # merges see this batch's earlier rows
            written = skipped = 0
            failures: list[tuple[int, str]] = []
            for row in rows:
                if row.offset < applied_up_to:
                    skipped += 1
                    continue
                if merge is replace_value:
                    merged = row.value
                else:
                    previous = (
                        pending[row.key]
                        if row.key in pending
                        else _value_of(column_family.get(row.key))
                    )
                    try:
                        merged = merge(previous, row.value)
                    except Exception as exc:  # noqa: BLE001 - user code: a poison row is skipped
                        failures.append((row.offset, f"merge failed: {first_line(exc)}"))
                        continue  # the key keeps its value
                pending[row.key] = merged
                if merged is None:
                    batch.delete(row.key, handle)
                else:
                    timestamp = _NO_TIME if row.timestamp_ms is None else row.timestamp_ms
                    batch.put(row.key, _VALUE_HEADER.pack(row.offset, timestamp) + merged, handle)
                written += 1

            if len(failures) >= MERGE_BROKEN_AFTER and written == 0:
                raise MergeBroken(
                    f"the merge failed on all {len(failures)} rows of a batch of partition "
                    f"{partition}, e.g. at offset {failures[0][0]}: {failures[0][1]}"
                )
            newest = _newer(current.newest_record_ms if current else None, newest_record_ms)
            checkpoint = Checkpoint(next_offset, newest, now_ms())
            batch.put(
                str(partition).encode(),
                _CHECKPOINT.pack(
                    next_offset, _NO_TIME if newest is None else newest, checkpoint.updated_at_ms
                ),
                self._checkpoints_handle,
            )
            self._db.write(batch)
            return ApplyResult(written, skipped, checkpoint, failures)

    def close(self) -> None:
        """Flush and release the directory's lock (column family objects hold the DB open)."""
        with self._write_lock:
            self._partitions = {}
            del self._checkpoints, self._checkpoints_handle
            self._db.close()
            del self._db


def _value_of(raw: bytes | None) -> bytes | None:
    return None if raw is None else raw[_VALUE_HEADER.size :]


def _newer(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)

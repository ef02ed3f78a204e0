"""Key serializers: the bytes a Kafka producer's key serializer wrote, rebuilt from key text.

A request carries its key as text (a path segment, query parameter or header); the partition
depends on the serialized bytes, so each format reproduces one of Kafka's serializers exactly:

| format | bytes written                                   | Kafka serializer                  |
|--------|-------------------------------------------------|-----------------------------------|
| string | UTF-8                                           | StringSerializer (default UTF-8)  |
| int32  | 4 bytes, big-endian two's complement            | IntegerSerializer                 |
| int64  | 8 bytes, big-endian two's complement            | LongSerializer                    |
| uuid   | the canonical lowercase 36-character string form| UUIDSerializer (`uuid.toString()`)|
| hex    | the bytes the hex digits spell                  | ByteArraySerializer (raw keys)    |
| base64 | the bytes decoded, standard or URL-safe alphabet| ByteArraySerializer (raw keys)    |
| json   | the text as a JSON string, non-ASCII as UTF-8   | Faust's `json` codec with orjson  |
| json-ascii | the text as a JSON string, non-ASCII `\\uXXXX` | Faust's `json` codec, stdlib json |

The two JSON formats take the key text as the *content* of a JSON string: `k1` routes as the
bytes `"k1"`, which is what Faust writes for a table key `"k1"` (tables serialize str keys as
JSON; `table_route` hashes the same bytes). Faust uses orjson when it is installed (its `fast`
extra), which writes non-ASCII characters as UTF-8 (`json`), and the standard library's
`json.dumps` otherwise, which escapes them (`json-ascii`); both escape `"`, `\\` and control
characters alike, so ASCII keys give the same bytes in either. Keys that are JSON numbers
(`42`) serialize to their digits: route them with `string`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from collections.abc import Callable

from partitioner.errors import KeyFormatError, UnknownKeyFormat

KeySerializer = Callable[[str], bytes]

# Java's Integer.parseInt/Long.parseLong accept an optional sign and ASCII digits only;
# Python's int() would also take spaces, underscores and non-ASCII digits, so we check first.
_DECIMAL = re.compile(r"[+-]?[0-9]+")
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")
_BASE64 = re.compile(r"[A-Za-z0-9+/_-]*={0,2}")


def serialize_string(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise KeyFormatError("string", text, "not encodable as UTF-8 (lone surrogate)") from exc


def _signed_big_endian(key_format: str, text: str, size: int) -> bytes:
    if not _DECIMAL.fullmatch(text):
        raise KeyFormatError(key_format, text, "expected a decimal integer such as 42 or -7")
    value = int(text)
    bits = size * 8
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if not low <= value <= high:
        raise KeyFormatError(key_format, text, f"out of range [{low}, {high}]")
    return value.to_bytes(size, "big", signed=True)


def serialize_int32(text: str) -> bytes:
    return _signed_big_endian("int32", text, 4)


def serialize_int64(text: str) -> bytes:
    return _signed_big_endian("int64", text, 8)


def serialize_uuid(text: str) -> bytes:
    try:
        parsed = uuid.UUID(text)
    except ValueError as exc:
        raise KeyFormatError(
            "uuid", text, "expected a UUID such as 123e4567-e89b-12d3-a456-426614174000"
        ) from exc
    return str(parsed).encode("ascii")


def serialize_hex(text: str) -> bytes:
    if not _HEX.fullmatch(text):
        raise KeyFormatError("hex", text, "expected an even number of hex digits")
    return bytes.fromhex(text)


def serialize_base64(text: str) -> bytes:
    if not _BASE64.fullmatch(text):
        raise KeyFormatError("base64", text, "contains characters outside the base64 alphabets")
    standard = text.rstrip("=").replace("-", "+").replace("_", "/")
    if len(standard) % 4 == 1:
        raise KeyFormatError("base64", text, "truncated: length is not a valid base64 length")
    padded = standard + "=" * (-len(standard) % 4)
    try:
        return base64.b64decode(padded, validate=True)
    except binascii.Error as exc:  # pragma: no cover - the checks above leave nothing for it
        raise KeyFormatError("base64", text, str(exc)) from exc


def _json_string(key_format: str, text: str, *, ensure_ascii: bool) -> bytes:
    # json.dumps(ensure_ascii=False) is byte-identical to orjson.dumps for every str orjson
    # accepts (property-tested in tests/partitioner); orjson refuses lone surrogates, so do we.
    try:
        return json.dumps(text, ensure_ascii=ensure_ascii).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise KeyFormatError(key_format, text, "not encodable as UTF-8 (lone surrogate)") from exc


def serialize_json(text: str) -> bytes:
    return _json_string("json", text, ensure_ascii=False)


def serialize_json_ascii(text: str) -> bytes:
    # All ASCII: never fails (the standard library writes even a lone surrogate as \udXXX).
    return _json_string("json-ascii", text, ensure_ascii=True)


KEY_SERIALIZERS: dict[str, KeySerializer] = {
    "string": serialize_string,
    "int32": serialize_int32,
    "int64": serialize_int64,
    "uuid": serialize_uuid,
    "hex": serialize_hex,
    "base64": serialize_base64,
    "json": serialize_json,
    "json-ascii": serialize_json_ascii,
}


def key_serializer(key_format: str) -> KeySerializer:
    """The serializer for a format name, resolved once (at configuration time, not per request)."""
    try:
        return KEY_SERIALIZERS[key_format]
    except KeyError:
        raise UnknownKeyFormat(key_format, tuple(KEY_SERIALIZERS)) from None


def serialize_key(text: str, key_format: str = "string") -> bytes:
    return key_serializer(key_format)(text)

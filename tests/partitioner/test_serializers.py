"""Key serializers reproduce Kafka's serializers byte for byte and reject bad key text."""

from __future__ import annotations

import struct
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from partitioner import KEY_FORMATS, KeyFormatError, UnknownKeyFormat, serialize_key

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@pytest.mark.parametrize(
    ("text", "key_format", "expected"),
    [
        ("customer-42", "string", b"customer-42"),
        ("ünïcødé", "string", "ünïcødé".encode()),
        ("🚂🎫", "string", b"\xf0\x9f\x9a\x82\xf0\x9f\x8e\xab"),
        ("", "string", b""),
        ("42", "int32", b"\x00\x00\x00\x2a"),
        ("-1", "int32", b"\xff\xff\xff\xff"),
        ("+7", "int32", b"\x00\x00\x00\x07"),  # Integer.parseInt accepts a plus sign
        ("007", "int32", b"\x00\x00\x00\x07"),
        ("-2147483648", "int32", b"\x80\x00\x00\x00"),
        ("2147483647", "int32", b"\x7f\xff\xff\xff"),
        ("42", "int64", b"\x00" * 7 + b"\x2a"),
        ("-9223372036854775808", "int64", b"\x80" + b"\x00" * 7),
        (
            "123E4567-E89B-12D3-A456-426614174000",  # UUIDSerializer writes toString(): lowercase
            "uuid",
            b"123e4567-e89b-12d3-a456-426614174000",
        ),
        ("{123e4567-e89b-12d3-a456-426614174000}", "uuid", b"123e4567-e89b-12d3-a456-426614174000"),
        ("00ff10", "hex", b"\x00\xff\x10"),
        ("", "hex", b""),
        ("AP8Q", "base64", b"\x00\xff\x10"),
        ("AP8=", "base64", b"\x00\xff"),
        ("AP8", "base64", b"\x00\xff"),  # padding may be left off in URLs
        ("_-8", "base64", b"\xff\xef"),  # URL-safe alphabet
        ("/+8=", "base64", b"\xff\xef"),  # standard alphabet, same bytes
    ],
)
def test_serializes_like_kafka(text, key_format, expected):
    assert serialize_key(text, key_format) == expected


@pytest.mark.parametrize(
    ("text", "key_format", "reason"),
    [
        ("\ud800", "string", "lone surrogate"),
        ("abc", "int32", "decimal integer"),
        ("1.0", "int32", "decimal integer"),
        (" 1", "int32", "decimal integer"),
        ("1_000", "int32", "decimal integer"),
        ("٣", "int32", "decimal integer"),  # an Arabic-Indic digit: int() would take it
        ("", "int32", "decimal integer"),
        ("2147483648", "int32", "out of range"),
        ("-2147483649", "int32", "out of range"),
        ("9223372036854775808", "int64", "out of range"),
        ("not-a-uuid", "uuid", "expected a UUID"),
        ("123e4567-e89b-12d3-a456-42661417400", "uuid", "expected a UUID"),
        ("0", "hex", "even number"),
        ("zz", "hex", "even number"),
        ("00 ff", "hex", "even number"),
        ("A", "base64", "truncated"),
        ("a$b=", "base64", "outside the base64 alphabets"),
        ("AP8===", "base64", "outside the base64 alphabets"),
    ],
)
def test_rejects_bad_key_text_with_a_reason(text, key_format, reason):
    with pytest.raises(KeyFormatError, match=reason) as caught:
        serialize_key(text, key_format)
    assert caught.value.key_format == key_format
    assert caught.value.key == text


def test_unknown_key_format_lists_the_known_ones():
    with pytest.raises(UnknownKeyFormat, match="int32") as caught:
        serialize_key("1", "int")
    assert caught.value.known == KEY_FORMATS


@given(INT32)
def test_int32_is_integer_serializer(value):
    assert serialize_key(str(value), "int32") == struct.pack(">i", value)


@given(INT64)
def test_int64_is_long_serializer(value):
    assert serialize_key(str(value), "int64") == struct.pack(">q", value)


@given(st.uuids())
def test_uuid_is_uuid_serializer(value):
    assert serialize_key(str(value).upper(), "uuid") == str(value).encode()
    assert serialize_key(value.hex, "uuid") == str(value).encode()


@given(st.binary(max_size=64))
def test_hex_and_base64_round_trip_any_bytes(raw):
    import base64  # noqa: PLC0415

    assert serialize_key(raw.hex(), "hex") == raw
    assert serialize_key(raw.hex().upper(), "hex") == raw
    assert serialize_key(base64.b64encode(raw).decode(), "base64") == raw
    assert serialize_key(base64.urlsafe_b64encode(raw).decode().rstrip("="), "base64") == raw


def test_uuid_module_forms_are_all_one_key():
    value = uuid.UUID("123e4567-e89b-12d3-a456-426614174000")
    forms = [str(value), value.hex, f"urn:uuid:{value}", f"{{{value}}}"]
    assert {serialize_key(form, "uuid") for form in forms} == {str(value).encode()}

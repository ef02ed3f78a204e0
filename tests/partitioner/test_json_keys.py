"""The `json` and `json-ascii` key formats write the bytes Faust writes, on a real broker.

Faust serializes a table's str keys with its `json` codec: orjson when installed (UTF-8), the
standard library otherwise (non-ASCII escaped). Each vector below was checked against real Faust
(`test_faust_wrote_these_bytes_where_we_route_them` sends the same keys through Faust's producer
and reads the raw key bytes back from the broker).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kroute.embedded import BrokerHandle
from kroute.topics import create_topics
from partitioner import KeyFormatError, KeyPartitioner, partition, serialize_key
from tests.kafka_helpers import read_topic

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 6

# (text, format, bytes Faust wrote, partition of 6 Faust's producer chose)
VECTORS = [
    ("k1", "json", b'"k1"', 2),
    ("customer-42", "json", b'"customer-42"', 1),
    ("", "json", b'""', 4),
    ("ké", "json", b'"k\xc3\xa9"', 3),
    ("🚂", "json", b'"\xf0\x9f\x9a\x82"', 4),
    ('a"b\\c', "json", b'"a\\"b\\\\c"', 4),
    ("\x00\n\x1f\x7f", "json", b'"\\u0000\\n\\u001f\x7f"', 2),
    ("\u2028", "json", b'"\xe2\x80\xa8"', 0),
    ("k1", "json-ascii", b'"k1"', 2),
    ("customer-42", "json-ascii", b'"customer-42"', 1),
    ("ké", "json-ascii", b'"k\\u00e9"', 2),
    ("🚂", "json-ascii", b'"\\ud83d\\ude82"', 4),
    ('a"b\\c', "json-ascii", b'"a\\"b\\\\c"', 4),
    ("\x00\n\x1f\x7f", "json-ascii", b'"\\u0000\\n\\u001f\\u007f"', 0),
    ("\u2028", "json-ascii", b'"\\u2028"', 5),
]


@pytest.mark.parametrize(("text", "key_format", "expected", "chosen"), VECTORS)
def test_vectors(text, key_format, expected, chosen):
    assert serialize_key(text, key_format) == expected
    assert partition(expected, PARTITIONS) == chosen
    assert KeyPartitioner(key_format, "murmur2", PARTITIONS).partition_of(text) == chosen


def test_text_is_the_string_content_not_a_json_document():
    # `42` is the JSON string "42" (what Faust writes for the str key "42"), not the number.
    assert serialize_key("42", "json") == b'"42"'
    assert serialize_key('"k1"', "json") == b'"\\"k1\\""'


@pytest.mark.parametrize("text", ["\ud800", "k\udfff"])
def test_json_refuses_lone_surrogates_like_orjson(text):
    with pytest.raises(KeyFormatError, match="lone surrogate") as caught:
        serialize_key(text, "json")
    assert caught.value.key_format == "json"
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps(text)


def test_json_ascii_writes_lone_surrogates_as_the_standard_library_does():
    assert serialize_key("\ud800", "json-ascii") == b'"\\ud800"'


@given(st.text())
def test_json_is_orjson(text):
    try:
        expected = orjson.dumps(text)
    except orjson.JSONEncodeError:
        with pytest.raises(KeyFormatError):
            serialize_key(text, "json")
    else:
        assert serialize_key(text, "json") == expected


@given(st.text())
def test_json_ascii_is_the_standard_library(text):
    assert serialize_key(text, "json-ascii") == json.dumps(text).encode("ascii")


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("key_format", "faust_flags"), [("json", []), ("json-ascii", ["--without-orjson"])]
)
def test_faust_wrote_these_bytes_where_we_route_them(
    broker: BrokerHandle, key_format: str, faust_flags: list[str]
):
    texts = sorted({text for text, fmt, _, _ in VECTORS if fmt == key_format})
    topic = f"faust-keys-{key_format}-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap_servers, {topic: PARTITIONS})
    sent = subprocess.run(
        [sys.executable, "-m", "tests.partitioner.faust_producer", broker.bootstrap_servers,
         topic, str(PARTITIONS), *faust_flags],
        input=json.dumps(texts), capture_output=True, text=True, cwd=ROOT, timeout=90, check=False,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr[-3000:]
    where = json.loads(sent.stdout.strip().splitlines()[-1])
    stored = {
        (r.partition, r.offset): r.key for r in read_topic(broker.bootstrap_servers, topic, 6)
    }
    for text in texts:
        chosen, offset = where[text]
        assert stored[(chosen, offset)] == serialize_key(text, key_format), text
        assert partition(serialize_key(text, key_format), PARTITIONS) == chosen, text

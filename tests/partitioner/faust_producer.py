"""Send keys through a real Faust producer and print where Faust put them (tests only).

    python -m tests.partitioner.faust_producer BOOTSTRAP TOPIC PARTITIONS [--without-orjson]

Reads one JSON list of key texts from stdin, sends each as a Faust table would key it (the
`json` key serializer, Faust's default for tables with str keys) and prints one JSON object:
key text -> [partition, offset], from the record metadata Faust's producer returned.
`--without-orjson` hides orjson before Faust is imported, so Faust takes its standard-library
JSON path, as it does wherever orjson is not installed.
"""

from __future__ import annotations

import asyncio
import json
import sys


async def send_all(bootstrap: str, topic_name: str, partitions: int, keys: list[str]) -> None:
    import faust  # noqa: PLC0415 - imported after orjson may have been hidden

    app = faust.App("kroute-key-vectors", broker=f"kafka://{bootstrap}", web_enabled=False)
    topic = app.topic(
        topic_name, key_type=str, value_type=str, key_serializer="json", partitions=partitions
    )
    await app.producer.start()
    try:
        sent = [await topic.send(key=key, value="v") for key in keys]
        await app.producer.flush()
        where = {
            key: [(await fut).partition, (await fut).offset]
            for key, fut in zip(keys, sent, strict=True)
        }
    finally:
        await app.producer.stop()
    print(json.dumps(where))


def main() -> None:
    bootstrap, topic, partitions = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if "--without-orjson" in sys.argv[4:]:
        sys.modules["orjson"] = None  # type: ignore[assignment]  # import orjson now fails
    asyncio.run(send_all(bootstrap, topic, partitions, json.load(sys.stdin)))


if __name__ == "__main__":
    main()

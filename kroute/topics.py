"""Create Kafka topics (the run command's demo topic, tests, benchmarks)."""

from __future__ import annotations

from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]


def create_topics(bootstrap_servers: str, partitions_by_topic: dict[str, int]) -> None:
    """Create each topic with its final partition count (Tansu cannot add partitions later)."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    new_topics = [NewTopic(name, count, 1) for name, count in partitions_by_topic.items()]
    for future in admin.create_topics(new_topics, operation_timeout=10).values():
        future.result(timeout=15)  # the admin client must live until its futures resolve

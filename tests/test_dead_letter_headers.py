"""A dead letter's headers: one declaration (`DeadLetterHeaders`) writes and reads them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepstream.projector import DeadLetterHeaders

pytestmark = [pytest.mark.fast, pytest.mark.once]


def test_the_wire_names_and_order_are_the_contract() -> None:
    headers = DeadLetterHeaders('seq_jump', 'seq 7 after 3', 'p.step-events', 2, 41, envelope=True).encode()
    assert headers == [
        ('stepstream-dlq-reason', b'seq_jump'),
        ('stepstream-dlq-detail', b'seq 7 after 3'),
        ('stepstream-source-topic', b'p.step-events'),
        ('stepstream-source-partition', b'2'),
        ('stepstream-source-offset', b'41'),
        ('stepstream-dlq-envelope', b'1'),
    ]
    assert len(DeadLetterHeaders('r', 'x' * 10_000, 't', 0, 0).encode()[1][1]) == 4096


@given(
    reason=st.text(min_size=1, max_size=40),
    detail=st.text(min_size=1, max_size=300),
    topic=st.text(min_size=1, max_size=60),
    partition=st.integers(0, 10_000),
    offset=st.integers(0, 2**62),
    envelope=st.booleans(),
)
def test_what_is_written_reads_back(
    reason: str, detail: str, topic: str, partition: int, offset: int, envelope: bool
) -> None:
    written = DeadLetterHeaders(reason, detail, topic, partition, offset, envelope)
    read = DeadLetterHeaders.decode(written.encode())
    assert read == written


@given(st.lists(st.tuples(st.text(max_size=30), st.one_of(st.none(), st.binary(max_size=30))), max_size=8))
def test_garbage_headers_read_as_unknown_never_raise(headers: list[tuple[str, bytes | None]]) -> None:
    read = DeadLetterHeaders.decode(headers)
    assert read.source_partition is None or read.source_partition >= 0

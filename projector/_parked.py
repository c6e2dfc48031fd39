"""`DecodedParked`: records parked before their run's registration, kept decoded for it.

A registration applies its parked records without decoding them again, in the batch that parked
them or a later one (the usual case live: transitions are fetched ahead of their run's
`run_started`). Anyone can park records, of up to the broker's message size, so the cache is
bounded: the oldest are dropped beyond `PARKED_DECODED` records or `PARKED_DECODED_BYTES`, and a
dropped one is decoded when drained.
"""

from __future__ import annotations

from stepstream.schemas import Fields, read_record

PARKED_DECODED = 16_384
PARKED_DECODED_BYTES = 32 << 20
"""How many parked records an `Applier` keeps decoded for their registration, and how many of
their bytes: records may be up to the broker's message size, and anyone can park them."""


class DecodedParked:
    """Parked records' fields by their parked key, each with its bytes (used only for those bytes)."""

    __slots__ = ('_bytes', '_kept')

    def __init__(self) -> None:
        self._kept: dict[bytes, tuple[bytes, Fields]] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, parked: object) -> bool:
        return parked in self._kept

    @property
    def size_bytes(self) -> int:
        """The bytes of the records kept."""
        return self._bytes

    def keep(self, parked: bytes, value: bytes, record: Fields) -> None:
        """Keep a parked record's fields for its registration, within the bounds."""
        self._forget(parked)
        self._kept[parked] = (value, record)
        self._bytes += len(value)
        while self._bytes > PARKED_DECODED_BYTES or len(self._kept) > PARKED_DECODED:
            self._forget(next(iter(self._kept)))

    def take(self, parked: bytes, value: bytes) -> Fields:
        """A parked record's fields: the kept ones if they are of these bytes, else decoded."""
        kept = self._forget(parked)
        return kept[1] if kept is not None and kept[0] == value else read_record(value)[1]

    def _forget(self, parked: bytes) -> tuple[bytes, Fields] | None:
        kept = self._kept.pop(parked, None)
        if kept is not None:
            self._bytes -= len(kept[0])
        return kept

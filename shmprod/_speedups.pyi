"""Types of the C extension (shmprod/_speedups.c); see :mod:`shmprod.speedups`."""

import threading
from typing import Any

class StageCore:
    values: list[bytes | None]
    keys: list[bytes | None]
    timestamps: list[int]
    n: int
    nbytes: int
    limit: int
    plain: bool

class FutureCore:
    _stage: Any
    _row: int
    def __init__(self, stage: Any, row: int) -> None: ...

class Stager:
    def __init__(
        self,
        stages: dict[str, list[Any]],
        lock: threading.Lock,
        future_type: type[Any],
        records_room: int,
        max_request_size: int,
        header_size: int,
        overhead_max: int,
        staged_overhead: int,
    ) -> None: ...
    def __call__(
        self,
        topic: object,
        value: object,
        key: object,
        headers: object,
        partition: object,
        timestamp_ms: object,
    ) -> Any: ...

"""The sender's time unit: every clock reading in the sender is ``now_ns``, nanoseconds
of ``time.monotonic_ns`` (passed in, so tests control time); options are milliseconds.
"""

from __future__ import annotations

from typing import Final

MS: Final = 1_000_000
"""Nanoseconds per millisecond."""

"""Sans-IO Kafka codec: bytes in, objects out. No sockets, no processes.

Modules:
- ``primitives``: fixed ints, varints, strings/bytes (normal, nullable, compact), tagged fields.
- ``frames``: request headers and a streaming response-frame decoder.
- ``messages``: the requests and responses the producer needs.
- ``records``: RecordBatch v2 encode/decode, one record at a time.
- ``vectorized``: RecordBatch v2 built from whole numpy/Arrow columns.
- ``compression``: none, gzip, snappy, lz4, zstd.
- ``error_codes``: Kafka error codes, names and retriability.
"""

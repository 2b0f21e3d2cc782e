"""The sender process: the one Kafka client of a host's shared producer.

Started by the owner as ``python -m shmprod.sender`` with its spec as JSON on stdin (a
fresh interpreter, never a fork; it imports no user code). Modules, one responsibility each:

- ``__main__``: entry point: map the segment, wrap the inherited listening socket, run.
- ``loop``: the single-threaded selector loop and the control-plane protocol.
- ``control``: one worker's non-blocking control connection (framed ipc messages).
- ``pool``: the free list, grants per worker, the FIFO of waiting allocations.
- ``accumulator``: per-partition queues of sealed batches.
- ``drain``: which batches go into the next ProduceRequest to a node.
- ``produce``: ProduceRequests from batches (zero copy) and answers back to batches.
- ``policy``: retry / fail / succeed decisions and backoff.
- ``idempotence``: the host-wide producer id/epoch and per-partition sequences.
- ``metadata``: nodes, leaders, the topic table in shared memory.
- ``network``: non-blocking broker connections (handshake, pipelining, timeouts).
- ``shmstate``: every shared-memory write the sender makes.
- ``lifecycle``: exit statuses, owner liveness, removing the producer's files.

Control-plane contract (what workers and the owner can rely on):

- The first message on a connection must be ``Hello`` with the right secret (compared
  with ``hmac.compare_digest``); anything else closes the connection. ``owner=True`` is
  accepted once, and only with ``pid == SenderSpec.owner_pid``. The answer is
  ``Welcome(worker_slot)``; the slot (zeroed, pid/start written, ``WORKER_ACTIVE``) is
  the worker's. More than ``max_workers`` attached: ``Fatal(ProducerError)`` and close.
  A connection that sends no Hello within 10 s is closed.
- ``Ready(0)`` goes to the owner once bootstrap metadata (and the producer id when
  idempotent) arrived, whether the owner attached before or after. If no broker answers
  within ``max(max_block_ms, 1 s)``: ``Ready(MetadataTimeoutError code, message)`` and
  ``Fatal`` to everyone, H_STATE=FAILED, exit 2.
- ``Alloc(request_id, run, count)`` is answered by exactly one ``Grant`` with the same
  request id: all ``count`` runs, or none with ``error`` set (``run`` < 1 or larger than
  the pool: RecordTooLargeError; ``run * count`` larger than the pool:
  BufferExhaustedError; closing: ProducerClosedError). Waiting requests are served in
  strict FIFO order (pool.py). The worker bounds its own wait.
- ``Sealed`` must name a run granted to that connection with the same ``run``; otherwise
  ``Done(CorruptBatchError)`` and nothing changes. A batch failing validation
  (length, framing, CRC, record count, transactional/control bits, a partition slot of
  no topic) is answered ``Done(CorruptBatchError)`` and its buffers are freed; other
  batches are unaffected.
- Each sealed batch gets exactly one ``Done(batch_id, ...)`` on the connection that
  sealed it (dropped if that connection has gone). ``error`` 0 with ``base_offset`` -1
  means delivered with the offset unknown (acks=0, or a resend the broker recognised as
  a duplicate). Error codes: Kafka's (positive) or shmprod's (negative); ``retriable``
  says whether a later send could succeed.
- ``Release(run, buffers)`` returns granted, unused runs. ``TopicRequest(request_id,
  name)`` (request ids > 0) is answered by one ``TopicInfo`` with that id;
  ``TopicInfo(request_id=0)`` is pushed to every worker when a partition count grows.
  ``topic_slot`` is -1 when ``error`` is set.
- ``Bye``: the worker leaves cleanly; its unsealed grants are reclaimed and the slot
  becomes FREE. EOF without Bye: the worker died; its unsealed grants are reclaimed
  (``buffers_reclaimed``), the slot becomes DEAD (reusable), its sealed batches are
  still delivered.
- ``Shutdown(timeout_ms)``, owner only (ignored from others): H_STATE=CLOSING, waiting
  and new Allocs and TopicRequests are refused with ProducerClosedError, queued and newly
  sealed batches are sent until nothing is queued or in flight or the timeout passes;
  the rest get ``Done(ProducerClosedError)``; then ``Fatal(ProducerClosedError)`` to
  every attached connection, H_STATE=CLOSED, the segment, socket file and its directory
  removed (the owner's removal after it finds them gone: an owner killed after the
  sender exited leaves nothing behind), exit 0.
- The owner's connection ending without Shutdown, or the owner process gone (the
  sender's parent changed): ``Done(OwnerDiedError)`` for every batch,
  ``Fatal(OwnerDiedError)`` to everyone, the segment, socket file and its directory
  removed, exit 3.
- An unexpected error in the loop: ``Fatal(ProducerError, "the sender process failed:
  ...")`` to everyone (and ``Ready`` with that error if still bootstrapping),
  H_STATE=FAILED, exit 1.
"""

"""nodeserver's own gRPC transport: HTTP/2 over TLS on the asyncio event loop, no C-core threads.

gRPC's C core spends about 1.3 ms of server CPU per attestation on thread hand-offs between its
event-engine threads, its poller and the asyncio loop, more than the attestation logic itself
(../shared/reference/attestation-cost.md). This package serves the same RPCs from the event
loop's own thread: TLS (OpenSSL on memory buffers), HTTP/2 framing and gRPC's length-prefixed
messages in :mod:`server.wire.h2` (one call's state in :mod:`server.wire.stream`), header blocks
in :mod:`server.wire.headers` (decoded by the ``hpack`` library), every handler registered exactly as on a ``grpc.aio`` server
(:mod:`server.wire.server`). Only what a gRPC server needs is implemented, and every input a
stranger controls is bounded (docs/attestation.md, "Transport").
"""

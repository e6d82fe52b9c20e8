"""The wire: `protocol` (every message type, field and convention; strict decoding with size
limits; nothing is unpickled), `sockets` (ROUTER/DEALER control plane, PUSH/PULL data plane, CURVE,
bounded receives), `shm` (shared-memory rings between workers on one host), `deadline`
(every wait is bounded), `reply` (serve a request, always answer) and `environment` (the
environment variables a coordinator sets for its workers).
"""

"""Plumbing every pdserve process shares, knowing no models: conversions between protobuf
wire types and the engine's dataclasses, gRPC settings and the server runner, TLS, bind and
advertised addresses, the internal plane's rules, typed RPC failures, logging, and the
Prometheus metrics (the router's registry and a worker's endpoint).

It sits just above ``engine`` and ``protos`` (whose types it converts) and below everything
else: ``kv_transfer``'s tcp backend takes its mTLS from here. The worker shell that both
worker roles build on is ``pdserve.shell``."""

"""Shared by the router and the workers: conversions between protobuf wire types and the
engine's dataclasses, and the gRPC server/channel settings every process uses."""

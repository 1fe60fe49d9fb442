"""Network settings both ends of the wire share: the MiB unit of message limits, gRPC keepalive, a TLS certificate
chain and key, and `host:port` addresses (split, and whether one is loopback-only).

The router's config (router/config.py) and the worker's gRPC server (workers/serve/server.py) both read these, so they
live below both.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

MIB = 1024 * 1024


class KeepaliveConfig(BaseModel):
    """gRPC keepalive, one setting for every connection of ours (contract/transport.py): a client pings a quiet
    connection every time_s and drops it when no answer comes within timeout_s; servers take those pings at any
    rate (https://github.com/grpc/grpc/blob/master/doc/keepalive.md)."""

    model_config = ConfigDict(extra="forbid")

    time_s: float = Field(20.0, gt=0)
    timeout_s: float = Field(10.0, gt=0)


class TlsConfig(BaseModel):
    """Serve TLS on the client-facing listeners with this certificate chain and private key (PEM)."""

    model_config = ConfigDict(extra="forbid")

    cert: Path
    key: Path


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def is_loopback(address: str) -> bool:
    host, _ = split_host_port(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name or a wildcard: treat as reachable from outside

"""Network settings both ends of the wire share: the MiB unit of message limits, a TLS certificate chain and key,
and `host:port` addresses (split, and whether one is loopback-only).

The router's config (router/config.py) and the worker's gRPC server (workers/serve/server.py) both read these, so they
live below both.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import BaseModel, ConfigDict

MIB = 1024 * 1024


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

"""The listening TCP sockets of given processes, read from /proc/net/tcp{,6} and /proc/<pid>/fd (no extra
dependency): what a test asserts about where a run can be reached from."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"  # the TCP state column of /proc/net/tcp


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    host: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    @property
    def loopback(self) -> bool:
        host = self.host
        if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped is not None:
            host = host.ipv4_mapped  # ::ffff:127.0.0.1, what gRPC's dual-stack sockets bind for 127.0.0.1
        return host.is_loopback


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _decode(hex_address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """/proc/net/tcp's '0100007F:1F90': the address as 32-bit words in host (little-endian) order, then the port."""
    host, port = hex_address.split(":")
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    return ipaddress.ip_address(raw), int(port, 16)


def listening_sockets(commands: dict[int, str]) -> list[Listener]:
    """Every LISTEN socket held by a process of `commands` (pid -> command line)."""
    owner = {inode: pid for pid in commands for inode in _socket_inodes(pid)}
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in owner:
                host, port = _decode(fields[1])
                pid = owner[fields[9]]
                found.append(Listener(pid, commands[pid], host, port))
    return found


"""Ray's network footprint: an embedded Ray binds and advertises loopback only and keeps its session files in a
directory the harness owns; a joined cluster's address must answer within a bounded time. Imports no Ray.

Ray turns a node address of 127.0.0.1 into the machine's interface address (`resolve_ip_for_localhost`), and its
GCS, raylet, object manager and core workers then listen on every interface. Only a node whose address really is
127.0.0.1 listens on loopback alone. Ray keeps 127.0.0.1 in its single-machine mode: the default on Windows and
macOS, switched by the documented `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`
(https://docs.ray.io/en/latest/cluster/getting-started.html, https://github.com/ray-project/ray/issues/30770),
which Ray reads once, when it is imported. Ray's own guidance is
not to expose its ports (https://docs.ray.io/en/latest/ray-security/index.html).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

LOCAL_MODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# A Unix socket path holds 107 bytes; the raylet's and the object store's sockets sit about 65 characters below
# the temp dir (<dir>/session_<date>_<pid>/sockets/plasma_store), so the temp dir itself stays short.
MAX_TEMP_DIR_CHARS = 40
PROBE_INTERVAL_S = 0.5


class RayUnreachable(Exception):
    """A --ray-address where no Ray cluster answers; the message is one line naming the address."""


def keep_ray_on_loopback() -> None:
    """Ray's local mode for this process and the Ray processes it starts; must run before `import ray`.

    A joined cluster is unaffected: the driver takes the address of the node it connects to. An operator's own
    setting of the switch wins (an embedded Ray then refuses to start off loopback: see `ray_workers.init_ray`)."""
    os.environ.setdefault(LOCAL_MODE_ENV, "0")


def make_temp_dir() -> Path:
    """A fresh directory for an embedded Ray's session files (Ray's `_temp_dir`), short enough for its sockets."""
    base = tempfile.gettempdir()
    if len(base) > MAX_TEMP_DIR_CHARS - 24:  # room for the prefix, the pid and mkdtemp's suffix
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix=f"q3vl-ray-{os.getpid()}-", dir=base))


def temp_dirs_of(pid: int) -> list[Path]:
    """The embedded-Ray temp dirs that process `pid` made and has not removed (what a test looks for)."""
    bases = {Path(tempfile.gettempdir()), Path("/tmp")}
    return sorted(path for base in bases for path in base.glob(f"q3vl-ray-{pid}-*"))


def remove_temp_dir(path: Path) -> None:
    """Removes an embedded Ray's session files once its processes have stopped."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        raise OSError(f"could not remove the embedded Ray's session files in {path}")


def probe_address(address: str, timeout_s: float) -> None:
    """Returns once something accepts a TCP connection at `address` (host:port, or ray://host:port); raises
    RayUnreachable after `timeout_s` otherwise. Ray's own connect retries for minutes; this bounds it."""
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(min(left, 5.0), 0.1)):
                return
        except OSError as exc:
            if time.monotonic() + PROBE_INTERVAL_S >= deadline:
                reason = exc.strerror or type(exc).__name__
                raise RayUnreachable(
                    f"--ray-address {address}: no Ray cluster answered within {timeout_s:g} s: {reason}") from None
        time.sleep(PROBE_INTERVAL_S)


def _host_port(address: str) -> tuple[str, int]:
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RayUnreachable(f"--ray-address {address}: not host:port (the Ray head's GCS address)")
    return host.strip("[]"), int(port)

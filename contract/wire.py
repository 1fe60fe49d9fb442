"""The generated protobuf/gRPC modules for contract/proto/q3vl.proto, built at first import.

Everything that speaks the wire contract imports `pb` (messages) and `pb_grpc` (stubs, servicers)
from here; generated code lives in contract/_generated/ (git-ignored) and is rebuilt when the .proto
changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import sys
from pathlib import Path

_PROTO = Path(__file__).with_name("proto") / "q3vl.proto"
_OUT = Path(__file__).with_name("_generated")


def _build() -> None:
    digest = hashlib.sha256(_PROTO.read_bytes()).hexdigest()
    stamp = _OUT / "SOURCE_SHA256"
    _OUT.mkdir(exist_ok=True)
    with open(_OUT / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several processes may import at once
        if stamp.exists() and stamp.read_text() == digest and (_OUT / "q3vl_pb2_grpc.py").exists():
            return
        from grpc_tools import protoc  # imported only when a build is needed

        import grpc_tools

        include = Path(grpc_tools.__file__).parent / "_proto"
        rc = protoc.main(
            [
                "protoc",
                f"-I{_PROTO.parent}",
                f"-I{include}",
                f"--python_out={_OUT}",
                f"--grpc_python_out={_OUT}",
                str(_PROTO),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed ({rc}) on {_PROTO}")
        stamp.write_text(digest)


_build()
if str(_OUT) not in sys.path:
    sys.path.insert(0, str(_OUT))  # the generated _grpc module imports its sibling by bare name
pb = importlib.import_module("q3vl_pb2")
pb_grpc = importlib.import_module("q3vl_pb2_grpc")

__all__ = ["pb", "pb_grpc"]

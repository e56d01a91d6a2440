"""A free TCP port for each multi-process launch, so concurrent test runs on one machine never collide."""

from __future__ import annotations

import socket


def free_port() -> int:
    """Returns a port that was free on 127.0.0.1 a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

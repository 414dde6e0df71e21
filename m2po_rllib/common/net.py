"""Addresses for the rendezvous a job opens itself (the native weight-sync group)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS's pick; another process may take it before it is
    bound again, which a rendezvous then reports as an address in use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_address() -> str:
    """This node's address as Ray's other nodes reach it (127.0.0.1 without Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"

"""Every accepted connection gets TCP_NODELAY (server/connections.py `_send_at_once`): with
Nagle's algorithm on, h11's two writes per response (head, then body) made each request after
the first on a keep-alive connection wait for the client's delayed ACK (44 ms, /health too).
Checked on real sockets: the option as the kernel reports it, not a timing."""

from __future__ import annotations

import socket

from ridgefill_server.connections import _send_at_once


class _Transport:
    """The one thing the protocol reads from asyncio's transport here: its socket."""

    def __init__(self, sock):
        self.sock = sock

    def get_extra_info(self, name):
        return self.sock if name == "socket" else None


def test_accepted_socket_gets_nodelay_though_asyncio_skips_proto_0_sockets():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:  # proto 0, as uvicorn's and ours
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()), listener.accept()[0] as accepted:
            assert accepted.proto == 0  # NOTE: why asyncio's own _set_nodelay passes it over
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
            _send_at_once(_Transport(accepted))
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_a_unix_socket_is_left_alone():
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        _send_at_once(_Transport(a))  # no TCP option to set: no error

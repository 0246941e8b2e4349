"""Bounds on client connections (loragate_common/http_server.py), through a real `loragate gateway` process.

A slowloris client (a request head or body trickled one byte at a time), a connection that sends nothing,
and more connections than --max-connections: each is answered (408 or 503, JSON) and closed, and the
server keeps serving everyone else. Before these bounds, such connections stayed open indefinitely.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.auth import hash_key
from loragate.cli import build_parser

from mock_upstream import MockUpstream
from polling import poll
from processes import start_gateway, stop_process

KEY = "slow-secret"
POLICY = f"""
version: 1
tenants:
  - id: acme
    api_keys: ["{hash_key(KEY)}"]
    adapters: ["*"]
"""
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, MAX_CONNECTIONS = 1.0, 1.5, 3


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, MockUpstream]]:
    tmp = tmp_path_factory.mktemp("slow")
    with MockUpstream() as mock:
        proc, url = start_gateway(
            tmp,
            "gateway",
            POLICY,
            [mock.url],
            "--header-timeout-s",
            str(HEADER_TIMEOUT_S),
            "--body-timeout-s",
            str(BODY_TIMEOUT_S),
            "--max-connections",
            str(MAX_CONNECTIONS),
        )
        try:
            yield url, mock
        finally:
            stop_process(proc)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(30)
    return sock


def _trickle(sock: socket.socket, data: bytes, every_s: float) -> None:
    """Send `data` one byte at a time until it is sent or the server closes the connection."""
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return
        time.sleep(every_s)


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """Read until the server closes: the status and JSON body of its one answer."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _serves(url: str) -> bool:
    resp = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    return resp.status_code == 200


def test_a_silent_connection_is_answered_408_and_closed(gateway: tuple[str, MockUpstream]) -> None:
    url, _ = gateway
    status, body = _answer(_connect(url))
    assert status == 408 and body["error"]["type"] == "request_timeout"
    assert "headers" in body["error"]["message"]
    assert _serves(url)


def test_a_trickled_request_head_is_answered_408_and_closed(gateway: tuple[str, MockUpstream]) -> None:
    url, _ = gateway
    sock = _connect(url)
    # Ten times slower overall than the timeout allows, however often each byte comes.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
    _trickle(sock, head, every_s=HEADER_TIMEOUT_S * 10 / len(head))
    status, body = _answer(sock)
    assert status == 408 and "headers" in body["error"]["message"]
    assert _serves(url)


def test_a_trickled_request_body_is_answered_408_and_closed(gateway: tuple[str, MockUpstream]) -> None:
    url, mock = gateway
    count = mock.count
    sock = _connect(url)
    body = json.dumps({"prompt": "hello there", "max_tokens": 2}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    _trickle(sock, body, every_s=BODY_TIMEOUT_S * 10 / len(body))
    status, answer = _answer(sock)
    assert status == 408 and "body" in answer["error"]["message"]
    assert mock.count == count  # nothing reached an engine
    assert _serves(url)


def test_connections_past_the_cap_are_answered_503_and_closed(gateway: tuple[str, MockUpstream]) -> None:
    url, mock = gateway
    mock.hold()  # requests in flight hold their connections open (no timer runs once a request is in)
    before = mock.count
    held = []
    try:
        request = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        for _ in range(MAX_CONNECTIONS):
            sock = _connect(url)
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer "
                + KEY.encode()
                + b"\r\nContent-Length: "
                + str(len(request)).encode()
                + b"\r\n\r\n"
                + request
            )
            held.append(sock)
        poll(lambda: mock.count == before + MAX_CONNECTIONS, 30, what="every held request reached the upstream")
        status, body = _answer(_connect(url))
        assert status == 503 and "connections" in body["error"]["message"]
    finally:
        mock.release()
    for sock in held:
        data = sock.recv(65536)
        assert data.startswith(b"HTTP/1.1 200"), data[:100]
        sock.close()
    assert _serves(url)


def test_engine_and_gateway_take_the_connection_flags(tmp_path: Path) -> None:
    parser = build_parser()
    for command in (["engine", "--model", "tiny-random"], ["gateway", "--policy", "p.yaml", "--upstream", "http://x"]):
        args = parser.parse_args(
            [
                *command,
                "--header-timeout-s",
                "2.5",
                "--body-timeout-s",
                "7",
                "--keep-alive-s",
                "3",
                "--max-connections",
                "9",
            ]
        )
        assert (args.header_timeout_s, args.body_timeout_s, args.keep_alive_s, args.max_connections) == (2.5, 7, 3, 9)
        for bad in (["--header-timeout-s", "0"], ["--body-timeout-s", "nan"], ["--max-connections", "0"]):
            with pytest.raises(SystemExit):
                parser.parse_args([*command, *bad])

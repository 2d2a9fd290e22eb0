"""The endpoint's HTTP layer (rltrain/workers/local_http.py) with the standard library's client: several requests on
one keep-alive connection, each answered in order with its JSON; a handler's HTTPError and its crash come back as
OpenAI-style JSON errors (the crash as a 500) on a connection that stays usable; a chunked body is answered 411;
stop() closes the connections clients still hold; the server listens on 127.0.0.1 only."""

import http.client
import json
import socket

import pytest

from rltrain.workers.local_http import HTTPError, LocalHTTPServer
from rltrain.workers.vllm_async import EventLoopThread


async def handle(request):
    if request.path == "/fail":
        raise HTTPError(400, "no", "refused")
    if request.path == "/crash":
        raise RuntimeError("the handler broke")
    return 200, {"method": request.method, "path": request.path, "body": request.json()}


@pytest.fixture
def server():
    events = EventLoopThread()
    server = LocalHTTPServer(handle)
    events.run(server.start())
    yield server, events
    events.run(server.stop())
    events.stop()


def _reply(connection):
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def test_keep_alive_requests_and_errors(server):
    server, _ = server
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for i in range(3):
        connection.request("POST", f"/x/{i}", body=json.dumps({"i": i}), headers={"Content-Type": "application/json"})
        assert _reply(connection) == (200, {"method": "POST", "path": f"/x/{i}", "body": {"i": i}})
    connection.request("GET", "/fail")
    assert _reply(connection) == (400, {"error": {"message": "no", "type": "invalid_request_error", "param": None,
                                                  "code": "refused"}})
    connection.request("GET", "/crash")
    status, reply = _reply(connection)
    assert status == 500 and reply["error"]["type"] == "server_error" and "the handler broke" in \
        reply["error"]["message"]
    connection.request("POST", "/y", body=b"{")
    status, reply = _reply(connection)
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    connection.request("GET", "/z")   # the same connection, still in order after the errors
    assert _reply(connection) == (200, {"method": "GET", "path": "/z", "body": None})
    connection.close()


def test_chunked_bodies_are_refused(server):
    server, _ = server
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n{\"a\": 1}\r\n0\r\n\r\n")
        reply = b""
        while chunk := sock.recv(4096):   # answered, then closed
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 411 ") and b"Content-Length" in body


def test_stop_closes_held_connections(server):
    server, events = server
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("GET", "/a")
    assert _reply(connection)[0] == 200   # the connection stays open (keep-alive)
    events.run(server.stop())
    assert connection.sock.recv(1) == b""   # closed by the server
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2)
    assert server.host == "127.0.0.1"

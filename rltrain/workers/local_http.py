"""A small HTTP/1.1 server for JSON APIs on an asyncio loop, bound to localhost: what the rollout worker's
OpenAI-compatible endpoint (rltrain/workers/chat_endpoint.py) is served with.

    server = LocalHTTPServer(handle)          # async handle(Request) -> (status, JSON-able payload)
    await server.start()                      # 127.0.0.1 on a free port: server.port
    ...
    await server.stop()                       # closes the listening socket and every open connection

The standard library only, so it runs in every environment rltrain installs in (aiohttp, fastapi and uvicorn come
with vllm, not with rltrain) and on the event loop the async vLLM engine already runs on, with no thread between a
request and the engine. It speaks what OpenAI clients (httpx) send: Content-Length bodies on keep-alive
connections; a chunked request body is answered 411. Errors are JSON, {"error": {"message", "type", "code"}}, the
OpenAI shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from http import HTTPStatus

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 2**20     # one request's body (a long conversation is a few MB)
MAX_HEADER_LINES = 100


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]     # lower-case names
    body: bytes

    def json(self):
        """The body as JSON (HTTPError 400 if it is not)."""
        try:
            return json.loads(self.body or b"null")
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise HTTPError(400, f"the request body is not valid JSON ({err})") from None


class HTTPError(Exception):
    """An error reply: its status and an OpenAI-style error object."""

    def __init__(self, status: int, message: str, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.payload = {"error": {"message": message, "type": kind, "param": None, "code": code}}


class LocalHTTPServer:
    def __init__(self, handle, host: str = "127.0.0.1"):
        self.handle, self.host = handle, host
        self.server, self.port, self.writers = None, None, set()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._connection, self.host, 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is None:
            return
        self.server.close()
        for writer in list(self.writers):   # keep-alive connections an agent's client still holds
            writer.close()
        await self.server.wait_closed()
        self.server = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                try:
                    request = await read_request(reader)
                except HTTPError as err:   # a malformed request: answered, then the connection closes
                    await write_response(writer, err.status, err.payload, keep_alive=False)
                    return
                if request is None:
                    return
                try:
                    status, payload = await self.handle(request)
                except HTTPError as err:
                    status, payload = err.status, err.payload
                except Exception as err:   # the handler's own failure (the engine's): a 500 the client can read
                    logger.exception("%s %s failed", request.method, request.path)
                    status, payload = 500, HTTPError(500, f"{type(err).__name__}: {err}", kind="server_error").payload
                keep_alive = request.headers.get("connection", "").lower() != "close"
                await write_response(writer, status, payload, keep_alive)
                if not keep_alive:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass   # the client went away (or sent a line past the stream's limit)
        finally:
            self.writers.discard(writer)
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request on the connection; None at its end."""
    line = await reader.readline()
    if not line.strip():
        return None
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HTTPError(400, f"malformed request line {line[:100]!r}")
    headers = {}
    for _ in range(MAX_HEADER_LINES):
        header = (await reader.readline()).decode("latin-1")
        if header in ("\r\n", "\n", ""):
            break
        name, _, value = header.partition(":")
        headers[name.strip().lower()] = value.strip()
    else:
        raise HTTPError(431, f"more than {MAX_HEADER_LINES} header lines")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HTTPError(411, "send the body with a Content-Length (chunked request bodies are not read)")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise HTTPError(400, f"malformed Content-Length {headers['content-length']!r}") from None
    if not 0 <= length <= MAX_BODY_BYTES:
        raise HTTPError(413, f"a request body holds at most {MAX_BODY_BYTES} bytes (got {length})")
    body = await reader.readexactly(length) if length else b""
    return Request(parts[0].upper(), parts[1], headers, body)


async def write_response(writer: asyncio.StreamWriter, status: int, payload, keep_alive: bool) -> None:
    body = json.dumps(payload).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
    writer.write(head.encode("latin-1") + body)
    await writer.drain()

"""A stand-in for the HF hub on 127.0.0.1: answers the API calls ``huggingface_hub`` makes to find and download a
model repository, serving one checkpoint folder under whatever repo id is asked. Point ``HF_ENDPOINT`` at ``url``.

Also a listener that accepts connections and never answers (a firewall that drops packets, seen from the client).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.helpers import Tripwire

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, folder: Path):
        self.files = {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body: bytes | None):
                path = self.path.split("?")[0]
                hub.requests.append(f"{self.command} {path}")
                if path.startswith("/api/models/") and "/tree/" in path:
                    data = json.dumps([{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                       for f, b in sorted(hub.files.items())]).encode()
                    return self._send(200, data, {"Content-Type": "application/json"}, body is not None)
                if path.startswith("/api/models/"):
                    repo = path.removeprefix("/api/models/").split("/revision/")[0]
                    data = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                       "siblings": [{"rfilename": f} for f in sorted(hub.files)]}).encode()
                    return self._send(200, data, {"Content-Type": "application/json"}, body is not None)
                if "/resolve/" in path:
                    name = path.rsplit("/", 1)[1]
                    if name not in hub.files:
                        return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, body is not None)
                    data = hub.files[name]
                    etag = hashlib.sha256(data).hexdigest()
                    return self._send(200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"',
                                                  "Content-Type": "application/octet-stream"}, body is not None)
                return self._send(404, b"{}", {}, body is not None)

            def _send(self, code, data, headers, with_body):
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if with_body:
                    self.wfile.write(data)

            def do_GET(self):
                self._reply(b"")

            def do_HEAD(self):
                self._reply(None)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Blackhole(Tripwire):
    """Accepts TCP connections and never sends a byte: what a client sees behind a firewall that drops replies."""

    def __init__(self):
        self.held: list[socket.socket] = []
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    def took(self, conn) -> None:
        self.held.append(conn)  # kept open, unanswered

    def close(self):
        for c in self.held:
            c.close()
        self.sock.close()


def closed_port_url() -> str:
    """An address on which nothing listens (connection refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"

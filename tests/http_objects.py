"""A real HTTP/1.1 object server on 127.0.0.1 for the remote-source tests: Range requests, ETags, faults.

`ObjectServer(files)` serves `files` ({"/path": bytes}) with HEAD (Content-Length, ETag,
Accept-Ranges) and GET (whole or `Range: bytes=a-b` / `bytes=a-` as 206 Partial Content).
`faults` ({"/path": kind}) makes one path misbehave the way a real store or proxy can:

* "wrong": the same length, other bytes (a replaced object, a broken proxy);
* "404": HEAD and GET answer 404;
* "truncate": GET promises the whole range in Content-Length, sends half, closes;
* "hang": HEAD answers, GET sends its headers and then nothing until the server stops;
* "redirect": HEAD and GET answer 302 to `redirect_to`;
* "redirect-get": HEAD answers as for the object, GET answers 302 to `redirect_to` (a server that
  tells HEAD one thing and GET another).

`requested` records every request as "METHOD /path".

`ranges` records every Range header received, so a test can see the reads were ranged.
"""

from __future__ import annotations

import hashlib
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HANG_LIMIT_S = 120.0  # a hung handler is released by stop(); this only bounds a test that never stops it


class ObjectServer:
    def __init__(self, files: dict[str, bytes], faults: dict[str, str] | None = None) -> None:
        self.files = dict(files)
        self.faults = dict(faults or {})
        self.ranges: list[tuple[str, str]] = []
        self.requested: list[str] = []
        self.redirect_to = "/elsewhere"
        self.released = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: aiohttp reuses connections like against a real store

            def log_message(self, *args: Any) -> None:  # quiet test output
                pass

            def _lookup(self) -> tuple[bytes | None, str]:
                path = self.path.split("?", 1)[0]
                server.requested.append(f"{self.command} {path}")
                fault = server.faults.get(path, "")
                if fault == "redirect" or (fault == "redirect-get" and self.command == "GET"):
                    self.send_response(302)
                    self.send_header("Location", server.redirect_to)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None, fault
                if fault == "404" or path not in server.files:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None, fault
                return server.files[path], fault

            def _headers(self, code: int, length: int, data: bytes, extra: dict[str, str]) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(length))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", '"' + hashlib.md5(data).hexdigest() + '"')
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()

            def do_HEAD(self) -> None:
                data, _ = self._lookup()
                if data is not None:
                    self._headers(200, len(data), data, {})

            def do_GET(self) -> None:
                data, fault = self._lookup()
                if data is None:
                    return
                body, code, extra = data, 200, {}
                header = self.headers.get("Range")
                if header:
                    server.ranges.append((self.path, header))
                    m = re.fullmatch(r"bytes=(\d+)-(\d*)", header.strip())
                    if not m or int(m.group(1)) >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    start = int(m.group(1))
                    end = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
                    body, code = data[start : end + 1], 206
                    extra = {"Content-Range": f"bytes {start}-{end}/{len(data)}"}
                if fault == "wrong":
                    body = bytes(b ^ 0x5A for b in body)
                self._headers(code, len(body), data, extra)
                if fault == "hang":
                    self.wfile.flush()
                    server.released.wait(HANG_LIMIT_S)
                    self.close_connection = True
                    return
                if fault == "truncate":
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="object-server", daemon=True)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def url(self, path: str) -> str:
        return self.base + path

    def start(self) -> ObjectServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)

    def __enter__(self) -> ObjectServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""A Hugging Face hub on 127.0.0.1 serving one model repository from a local folder: the
requests ``huggingface_hub.snapshot_download`` makes (the revision, the file tree, each file's
metadata and bytes), so that a test sees which files a command downloads. Point a process at
it with ``HF_ENDPOINT=server.url``."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
JSON = {"Content-Type": "application/json"}


class HubServer:
    """``repo`` (``org/name``) at :data:`COMMIT`, its files those of ``folder``; ``requested``
    lists the files whose bytes were sent, in order."""

    def __init__(self, repo: str, folder: Path) -> None:
        self.repo, self.folder, self.requested = repo, Path(folder), []
        handler = type("Handler", (_Handler,), {"hub": self})
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.iterdir() if p.is_file())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    hub: HubServer

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        hub, path = self.hub, self.path.split("?")[0]
        if path.startswith(f"/api/models/{hub.repo}/revision/"):
            info = {"id": hub.repo, "sha": COMMIT, "siblings": [{"rfilename": p.name} for p in hub.files()]}
            return self._send(200, json.dumps(info).encode(), JSON, body)
        if path.startswith(f"/api/models/{hub.repo}/tree/"):
            tree = [{"type": "file", "path": p.name, "size": p.stat().st_size, "oid": _oid(p)} for p in hub.files()]
            return self._send(200, json.dumps(tree).encode(), JSON, body)
        prefix = f"/{hub.repo}/resolve/"
        file = hub.folder / path[len(prefix) :].split("/", 1)[-1] if path.startswith(prefix) else None
        if file is None or not file.is_file():
            return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
        if body:
            hub.requested.append(file.name)
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_oid(file)}"', "Content-Type": "application/octet-stream"}
        return self._send(200, file.read_bytes(), headers, body)

    def _send(self, code: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)


def _oid(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()

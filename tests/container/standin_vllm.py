#!/usr/bin/env python3
"""Stand-in `vllm` executable for the container test (stdlib only, no torch).

Installed as /usr/local/bin/vllm in a test-only layer on top of the project's
image, so the real entrypoint (manifest print, placeholder-key refusal) runs and
execs `vllm serve <the compose command>` into this. It does what the real
server does with the things the container test checks, and nothing else:

- reads <model>/config.json and <model>/model.safetensors.index.json and opens
  every weight file the index names (through symlinks: the MTP overlay's shards
  point into the checkpoint mount), parsing each safetensors header; any
  failure exits 3 before listening, as vLLM's loader would fail;
- checks the bearer key like vLLM (`--api-key` or VLLM_API_KEY; /health is
  open, /v1/* needs it);
- answers /v1/models, /v1/completions, /v1/chat/completions with a fixed
  token, so compose's healthcheck command can run against it.

It prints one line `standin-vllm: {json}` with what it loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def load_checkpoint(model: Path) -> dict:
    config = json.loads((model / "config.json").read_text())
    index = json.loads((model / "model.safetensors.index.json").read_text())
    files = {}
    for name in sorted(set(index["weight_map"].values())):
        p = model / name
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        files[name] = {"realpath": os.path.realpath(p), "symlink": p.is_symlink(),
                       "tensors": sorted(k for k in header if k != "__metadata__")}
    return {"model": str(model), "config": config, "files": files}


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] != "serve":
        print("standin-vllm: only `vllm serve MODEL ...` is implemented", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="vllm serve")
    ap.add_argument("model")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name")
    ap.add_argument("--api-key")
    args, rest = ap.parse_known_args(sys.argv[2:])
    try:
        loaded = load_checkpoint(Path(args.model))
    except Exception as e:  # noqa: BLE001 - report and refuse, as the loader would
        print(f"standin-vllm: cannot load {args.model}: {type(e).__name__}: {e}", file=sys.stderr)
        return 3
    name = args.served_model_name or args.model
    key = args.api_key or os.environ.get("VLLM_API_KEY")
    print("standin-vllm: " + json.dumps({**loaded, "served_model_name": name, "other_args": rest,
                                         "auth": bool(key)}), flush=True)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if self.path == "/health" or not key:
                return True
            if self.headers.get("Authorization") == f"Bearer {key}":
                return True
            self._send(401, {"error": "Unauthorized"})
            return False

        def do_GET(self):  # noqa: N802
            if not self._authorized():
                return
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            else:
                self._send(404, {"error": self.path})

        def do_POST(self):  # noqa: N802
            if not self._authorized():
                return
            n = int(self.headers.get("Content-Length") or 0)
            req = json.loads(self.rfile.read(n) or b"{}")
            if req.get("model") != name:
                self._send(404, {"error": f"model {req.get('model')!r} does not exist"})
            elif self.path == "/v1/completions":
                self._send(200, {"object": "text_completion", "model": name,
                                 "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}]})
            elif self.path == "/v1/chat/completions":
                self._send(200, {"object": "chat.completion", "model": name,
                                 "choices": [{"index": 0, "finish_reason": "length",
                                              "message": {"role": "assistant", "content": "ok"}}]})
            else:
                self._send(404, {"error": self.path})

        def log_message(self, fmt, *a):
            print("standin-vllm: " + fmt % a, file=sys.stderr, flush=True)

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

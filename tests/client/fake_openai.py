"""A small OpenAI-style server for the client-tool tests (stdlib only).

Listens on 127.0.0.1 (an ephemeral port) and answers like `vllm serve` does
where the tools look: SSE-streamed /v1/chat/completions with a usage chunk,
/v1/completions with logprobs, json_schema response_format, /health,
/metrics (with the preemption counter), /tokenize and /v1/models. Timing is
controlled: the first token comes `ttft + prefill_per_token * prompt_tokens`
seconds after the request, then one token every `itl` seconds (a list is
used cyclically), so a client's measured TTFT/ITL can be checked against it.

Failure modes for the tests: every k-th json_schema request answers 500
(`fail_500_every`) or returns text that is not JSON (`invalid_json_every`);
needle questions can be answered wrongly (`needle_wrong`); completions'
logprobs get a bias and Gaussian noise (`logprob_bias`, `logprob_noise`) and
can switch token at one position (`diverge_at`).

Run standalone (the smoke.sh test uses this as a stand-in for `vllm serve`):
    python fake_openai.py --port 8001 --api-key KEY [--log-gates LINE]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "qwen3.8-flash-next"
TOKEN_RE = re.compile(r"\w+|[^\w\s]")
NEEDLE_Q_RE = re.compile(r"passphrase for room (\d+)\?")
NEEDLE_RE = re.compile(r"The secret passphrase for room (\d+) is ([A-Za-z0-9-]+)\.")


def fake_tokens(text: str) -> list[str]:
    return TOKEN_RE.findall(text)


def stable_seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("\x00".join(map(str, parts)).encode()).digest()[:8], "little")


@dataclasses.dataclass
class FakeConfig:
    ttft: float = 0.05
    prefill_per_token: float = 0.0
    itl: float | list = 0.02
    api_key: str | None = "test-key"
    model: str = MODEL
    default_max_tokens: int = 16
    fail_500_every: int = 0
    invalid_json_every: int = 0
    preemptions: int = 0
    preempt_above: int | None = None  # a chat request starting with more active counts one preemption
    needle_wrong: set = dataclasses.field(default_factory=set)
    logprob_bias: float = 0.0
    logprob_noise: float = 0.0
    noise_seed: int = 0
    diverge_at: int | None = None
    tokenize: bool = True
    metrics: bool = True
    stream_error_after: int | None = None  # stream: after this many tokens send an error event
    abort_after: int | None = None  # stream: after this many tokens close the connection
    itl_file: str | None = None  # if this file exists, its number replaces `itl` (set by fake_compose.py)
    ttft_file: str | None = None  # the same for `ttft`
    unhealthy_file: str | None = None  # while this file exists, /health answers 503
    # usage.prompt_tokens_details.cached_tokens (vLLM --enable-prompt-tokens-details): a prompt
    # sent before counts its whole 16-token blocks as cached, a new one 0
    report_cached: bool = False


class FakeState:
    def __init__(self, cfg: FakeConfig):
        self.cfg = cfg
        self.lock = threading.Lock()
        self.requests: list[tuple[str, dict]] = []
        self.schema_count = 0
        self.active = 0
        self.max_active = 0
        # Gaps (s) between consecutive content chunks as actually sent: the
        # truth a client-side ITL is compared against (sleep can overshoot on
        # a loaded machine; the measurement must follow what was sent).
        self.sent_gaps: list[float] = []
        self.noise = random.Random(cfg.noise_seed)
        self.seen_prompts: set[str] = set()

    def itl(self, i: int) -> float:
        d = self.cfg.itl
        if self.cfg.itl_file:
            try:
                with open(self.cfg.itl_file) as f:
                    d = float(f.read())
            except (OSError, ValueError):
                pass
        return d[i % len(d)] if isinstance(d, (list, tuple)) else d


def example_for(schema: dict):
    """A deterministic instance of a (simple) JSON schema."""
    t = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if t == "object":
        props = schema.get("properties", {})
        return {k: example_for(v) for k, v in props.items()}
    if t == "array":
        return [example_for(schema.get("items", {"type": "string"}))] * max(1, schema.get("minItems", 1))
    if t == "integer":
        return 1
    if t == "number":
        return 1.5
    if t == "boolean":
        return True
    if t == "null":
        return None
    return "ok"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-vllm/0.1"

    def setup(self):
        super().setup()
        # Small SSE writes must leave at once (Nagle + delayed ACK adds 40 ms).
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):  # keep test output clean
        pass

    @property
    def st(self) -> FakeState:
        return self.server.state  # type: ignore[attr-defined]

    # -- helpers -----------------------------------------------------------

    def send_json(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def send_text(self, code: int, text: str, ctype: str = "text/plain") -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def authorized(self) -> bool:
        key = self.st.cfg.api_key
        if not key or not self.path.startswith("/v1"):
            return True
        if self.headers.get("Authorization") == f"Bearer {key}":
            return True
        self.send_json(401, {"error": "Unauthorized"})
        return False

    def body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    # -- routes ------------------------------------------------------------

    def do_GET(self):
        if not self.authorized():
            return
        if self.path == "/health":
            uf = self.st.cfg.unhealthy_file
            self.send_text(503 if uf and os.path.exists(uf) else 200, "")
        elif self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": self.st.cfg.model, "object": "model"}]})
        elif self.path == "/metrics" and self.st.cfg.metrics:
            n = self.st.cfg.preemptions
            self.send_text(200, "# HELP vllm:num_preemptions_total Cumulative number of preemption.\n"
                                "# TYPE vllm:num_preemptions_total counter\n"
                                f'vllm:num_preemptions_total{{engine="0",model_name="{self.st.cfg.model}"}} {float(n)}\n'
                                f'vllm:num_requests_running{{engine="0",model_name="{self.st.cfg.model}"}} '
                                f"{float(self.st.active)}\n")
        else:
            self.send_json(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        if not self.authorized():
            return
        try:
            body = self.body()
        except ValueError:
            self.send_json(400, {"error": "body is not JSON"})
            return
        with self.st.lock:
            self.st.requests.append((self.path, body))
        if self.path == "/v1/chat/completions":
            self.chat(body)
        elif self.path == "/v1/completions":
            self.completions(body)
        elif self.path == "/tokenize" and self.st.cfg.tokenize:
            text = body.get("prompt", "")
            toks = fake_tokens(text)
            self.send_json(200, {"count": len(toks), "max_model_len": 262144,
                                 "tokens": [stable_seed(t) % 1000 for t in toks]})
        else:
            self.send_json(404, {"error": f"no route {self.path}"})

    # -- chat --------------------------------------------------------------

    def chat(self, body: dict) -> None:
        cfg, st = self.st.cfg, self.st
        msgs = body.get("messages") or []
        prompt = "\n".join(m.get("content") or "" for m in msgs if isinstance(m.get("content"), str))
        n_prompt = len(fake_tokens(prompt))
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or cfg.default_max_tokens
        rf = body.get("response_format") or {}
        if rf.get("type") == "json_schema":
            with st.lock:
                st.schema_count += 1
                k = st.schema_count
            if cfg.fail_500_every and k % cfg.fail_500_every == 0:
                self.send_json(500, {"object": "error", "message": "Internal Server Error",
                                     "type": "InternalServerError", "code": 500})
                return
            text = json.dumps(example_for(rf["json_schema"]["schema"]))
            if cfg.invalid_json_every and k % cfg.invalid_json_every == 0:
                text = text[:-1]  # cut: not JSON any more
            pieces = re.findall(r".{1,4}", text, re.S)
        else:
            last = next((m.get("content") or "" for m in reversed(msgs) if m.get("role") == "user"), "")
            q = NEEDLE_Q_RE.search(last)
            if q:
                room = q.group(1)
                found = dict(NEEDLE_RE.findall(prompt))
                ans = found.get(room, "unknown")
                if int(room) in cfg.needle_wrong:
                    ans = "I could not find it"
                pieces = ["The", " passphrase", " is", f" {ans}", "."]
            else:
                pieces = [f" tok{i}" for i in range(max_tokens)]
        pieces = pieces[:max_tokens] if rf.get("type") != "json_schema" else pieces
        with st.lock:
            st.active += 1
            st.max_active = max(st.max_active, st.active)
            if cfg.preempt_above is not None and st.active > cfg.preempt_above:
                cfg.preemptions += 1
        try:
            ttft = cfg.ttft
            if cfg.ttft_file:
                try:
                    with open(cfg.ttft_file) as f:
                        ttft = float(f.read())
                except (OSError, ValueError):
                    pass
            delay = ttft + cfg.prefill_per_token * n_prompt
            usage = {"prompt_tokens": n_prompt, "completion_tokens": len(pieces),
                     "total_tokens": n_prompt + len(pieces)}
            if cfg.report_cached:
                with st.lock:
                    seen = prompt in st.seen_prompts
                    st.seen_prompts.add(prompt)
                usage["prompt_tokens_details"] = {"cached_tokens": n_prompt // 16 * 16 if seen else 0}
            if not body.get("stream"):
                time.sleep(delay + sum(st.itl(i) for i in range(max(0, len(pieces) - 1))))
                self.send_json(200, {"id": "chatcmpl-fake", "object": "chat.completion", "model": cfg.model,
                                     "choices": [{"index": 0, "finish_reason": "length" if len(pieces) >= max_tokens else "stop",
                                                  "message": {"role": "assistant", "content": "".join(pieces)}}],
                                     "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": cfg.model}
            # vLLM's first chunk: the role, empty content (not a token).
            self.sse(dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]))
            time.sleep(delay)
            for i, p in enumerate(pieces):
                if i:
                    time.sleep(st.itl(i - 1))
                if cfg.abort_after is not None and i == cfg.abort_after:
                    return
                if cfg.stream_error_after is not None and i == cfg.stream_error_after:
                    self.sse({"object": "error", "message": "engine dead", "type": "InternalServerError",
                              "code": 500})
                    self.raw_chunk(b"data: [DONE]\n\n")
                    self.raw_chunk(b"")
                    return
                self.sse(dict(base, choices=[{"index": 0, "delta": {"content": p}, "finish_reason": None}]))
                now = time.perf_counter()
                if i:
                    with st.lock:
                        st.sent_gaps.append(now - last_sent)
                last_sent = now
            self.sse(dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": "length"}]))
            if (body.get("stream_options") or {}).get("include_usage"):
                self.sse(dict(base, choices=[], usage=usage))
            self.raw_chunk(b"data: [DONE]\n\n")
            self.raw_chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with st.lock:
                st.active -= 1

    def sse(self, obj) -> None:
        self.raw_chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def raw_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    # -- completions with logprobs ---------------------------------------

    def completions(self, body: dict) -> None:
        cfg, st = self.st.cfg, self.st
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else json.dumps(prompt)
        n = body.get("max_tokens") or cfg.default_max_tokens
        rng = random.Random(stable_seed("completion", prompt, body.get("seed")))
        ids, lps = [], []
        for i in range(n):
            tid = rng.randrange(1000)
            base_lp = -abs(rng.gauss(0.0, 0.5))
            if cfg.diverge_at is not None and i >= cfg.diverge_at:
                tid = (tid + 1 + i) % 1000
            with st.lock:
                noise = st.noise.gauss(0.0, cfg.logprob_noise) if cfg.logprob_noise else 0.0
            ids.append(tid)
            lps.append(min(0.0, base_lp + cfg.logprob_bias + noise))
        as_ids = body.get("return_tokens_as_token_ids")
        toks = [f"token_id:{t}" if as_ids else f" w{t}" for t in ids]
        choice = {"index": 0, "text": "".join(f" w{t}" for t in ids), "finish_reason": "length"}
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"tokens": toks, "token_logprobs": lps,
                                  "top_logprobs": [{t: lp} for t, lp in zip(toks, lps)],
                                  "text_offset": list(range(len(toks)))}
        time.sleep(cfg.ttft)
        self.send_json(200, {"id": "cmpl-fake", "object": "text_completion", "model": cfg.model,
                             "choices": [choice],
                             "usage": {"prompt_tokens": len(fake_tokens(prompt)), "completion_tokens": n}})


class FakeServer:
    """with FakeServer(FakeConfig(...)) as srv: srv.base_url -> 'http://127.0.0.1:PORT/v1'."""

    def __init__(self, cfg: FakeConfig | None = None, port: int = 0):
        self.cfg = cfg or FakeConfig()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.state = FakeState(self.cfg)  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

    @property
    def state(self) -> FakeState:
        return self.httpd.state  # type: ignore[attr-defined]

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "FakeServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--startup-delay", type=float, default=0.0, help="seconds before listening")
    ap.add_argument("--log-gates", default=None, help="a line to print to stderr at start (the gates line)")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="exit after this long (bounded)")
    args = ap.parse_args()
    if args.log_gates:
        print(args.log_gates, file=sys.stderr, flush=True)
    time.sleep(args.startup_delay)
    srv = FakeServer(FakeConfig(api_key=args.api_key, ttft=0.01, itl=0.001), port=args.port).start()
    print(f"fake server on {srv.base_url}", file=sys.stderr, flush=True)
    try:
        time.sleep(args.max_seconds)
    except KeyboardInterrupt:
        pass
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

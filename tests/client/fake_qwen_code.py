"""fake_openai's server, plus what vLLM does with qwen-code's tool traffic.

Requests with `tools` are answered with OpenAI tool calls, streamed as vLLM
streams them (a first delta with id, type, name and empty arguments, then
argument pieces, finish_reason "tool_calls") or in one message. tool_choice
"required" calls the first tool with arguments built from its schema; auto
turns say a few words and call the first tool. usage carries
prompt_tokens_details.cached_tokens from a prefix cache model: the longest
common token prefix with any earlier prompt, floored to `block` tokens; TTFT
grows with the uncached tokens (`prefill_per_token`).

Failure modes, every k-th request with tools: HTTP 500 (`http500_every`), an
empty completion (`empty_every`), arguments that are not JSON
(`malformed_every`), arguments missing a required field (`bad_schema_every`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import ThreadingHTTPServer

from fake_openai import FakeConfig, FakeServer, FakeState, Handler, example_for, fake_tokens


@dataclasses.dataclass
class QwenCodeConfig(FakeConfig):
    block: int = 64
    http500_every: int = 0
    empty_every: int = 0
    malformed_every: int = 0
    bad_schema_every: int = 0
    report_cached: bool = True


class QwenCodeState(FakeState):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.tool_count = 0
        self.prompts: list[list[str]] = []


def prompt_tokens(body: dict) -> list[str]:
    parts = [json.dumps(body.get("tools") or [])]
    for m in body.get("messages") or []:
        if isinstance(m.get("content"), str):
            parts.append(m["content"])
        for c in m.get("tool_calls") or []:
            parts.append(json.dumps(c.get("function") or {}))
    return fake_tokens("\n".join(parts))


def _lcp(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class QwenCodeHandler(Handler):
    def chat(self, body: dict) -> None:
        if not body.get("tools"):
            return super().chat(body)
        cfg, st = self.st.cfg, self.st
        toks = prompt_tokens(body)
        with st.lock:
            st.tool_count += 1
            k = st.tool_count
            hit = max((_lcp(toks, p) for p in st.prompts), default=0)
            st.prompts.append(toks)
        cached = min(hit, len(toks) - 1) // cfg.block * cfg.block
        if cfg.http500_every and k % cfg.http500_every == 0:
            self.send_json(500, {"object": "error", "message": "Internal Server Error",
                                 "type": "InternalServerError", "code": 500})
            return
        tool = body["tools"][0]["function"]
        required = body.get("tool_choice") == "required"
        args = json.dumps(example_for(tool.get("parameters") or {}))
        if cfg.malformed_every and k % cfg.malformed_every == 0:
            args = args[:-1]
        elif cfg.bad_schema_every and k % cfg.bad_schema_every == 0:
            args = "{}"
        content = "" if required else "Let me check that."
        calls = [{"id": f"chatcmpl-tool-{k}", "type": "function",
                  "function": {"name": tool["name"], "arguments": args}}]
        if cfg.empty_every and k % cfg.empty_every == 0:
            content, calls = "", []
        usage = {"prompt_tokens": len(toks), "completion_tokens": 8, "total_tokens": len(toks) + 8}
        if cfg.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        delay = cfg.ttft + cfg.prefill_per_token * (len(toks) - cached)
        finish = "tool_calls" if calls else "stop"
        if not body.get("stream"):
            time.sleep(delay)
            msg = {"role": "assistant", "content": content or None}
            if calls:
                msg["tool_calls"] = calls
            self.send_json(200, {"id": "chatcmpl-fake", "object": "chat.completion", "model": cfg.model,
                                 "choices": [{"index": 0, "finish_reason": finish, "message": msg}],
                                 "usage": usage})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": cfg.model}

        def choice(delta, fr=None):
            self.sse(dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": fr}]))

        try:
            choice({"role": "assistant", "content": ""})
            time.sleep(delay)
            for w in content.split(" ") if content else []:
                choice({"content": w + " "})
                time.sleep(st.itl(0))
            for i, c in enumerate(calls):
                choice({"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                        "function": {"name": c["function"]["name"], "arguments": ""}}]})
                a = c["function"]["arguments"]
                for j in range(0, len(a), 8):
                    choice({"tool_calls": [{"index": i, "function": {"arguments": a[j:j + 8]}}]})
            choice({}, finish)
            if (body.get("stream_options") or {}).get("include_usage"):
                self.sse(dict(base, choices=[], usage=usage))
            self.raw_chunk(b"data: [DONE]\n\n")
            self.raw_chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            pass


class QwenCodeServer(FakeServer):
    def __init__(self, cfg: QwenCodeConfig | None = None, port: int = 0):
        self.cfg = cfg or QwenCodeConfig()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), QwenCodeHandler)
        self.httpd.daemon_threads = True
        self.httpd.state = QwenCodeState(self.cfg)  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)

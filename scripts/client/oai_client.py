"""Shared client code for the vllm-3x3090 client tools (stdlib only).

bench_serving.py, needle.py, stress_structured.py, logprob_ab.py and ab.py
import this module; it has no dependency outside the Python standard library
so the tools run with any python3 >= 3.9 on the serving host, venv or not.

What is here
  Client        OpenAI-style HTTP client: streaming chat (SSE) with client-side
                timestamps of every content chunk, plain JSON posts, /metrics,
                /tokenize, /health.
  filler_text   deterministic filler prompts of a given token length.
  stats         median / percentile / mean helpers.
  validate      a small JSON-schema checker (the subset structured output uses).

Why client-side timing: the server's "Avg prompt throughput" log line adds a
prompt's whole token count to the 10 s window in which its first token came
out, so it reads "prompt length / 10 s" whatever the real TTFT was (SPEC §1:
a 42k prompt logged 4,206 tok/s while its first token took 100 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import http.client
import json
import math
import os
import random
import re
import sys
import time
import urllib.parse

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_MODEL = "qwen3.8-flash-next"
API_KEY_ENV = "VLLM_API_KEY"

# Preemption counter names vLLM exports on /metrics (v1 engine: a Counter
# "vllm:num_preemptions", exposed with the Prometheus "_total" suffix).
PREEMPTION_METRICS = ("vllm:num_preemptions_total", "vllm:num_preemptions")


class ClientError(Exception):
    """A failure the user can act on; the message says what to do."""


def add_common_args(ap, *, model: bool = True) -> None:
    """--base-url, --api-key, --model, --timeout: the same in every tool."""
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL") or env_base_url(),
                    help="OpenAI-compatible base URL, with /v1 (default: $OPENAI_BASE_URL, else "
                         "http://127.0.0.1:$PORT/v1 with PORT (and HOST_BIND) from the environment or "
                         "the repo's .env: %(default)s)")
    ap.add_argument("--api-key", default=None,
                    help=f"Bearer token (default: ${API_KEY_ENV}, else $OPENAI_API_KEY, else none)")
    if model:
        ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL", DEFAULT_MODEL),
                        help="served model name (default: $OPENAI_MODEL or %(default)s)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds one request may take in total (default: %(default)s; a 250k-token "
                         "cold prefill takes minutes)")


def dotenv_value(name: str, path: str | None = None) -> str | None:
    """NAME's value in the repository's .env (the file compose reads), or None.
    Plain NAME=VALUE lines only (quotes stripped); no interpolation."""
    path = path or os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".env")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    val = None
    for ln in lines:
        m = re.match(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*$", ln)
        if m and m.group(1) == name:
            v = m.group(2)
            if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
                v = v[1:-1]
            elif " #" in v:
                v = v.split(" #", 1)[0].rstrip()
            val = v
    return val


def env_base_url() -> str:
    """http://HOST:PORT/v1 of the compose service: PORT and HOST_BIND from the
    environment, else from the repo's .env (compose publishes ${PORT:-8000}
    on ${HOST_BIND:-127.0.0.1}); 0.0.0.0 / :: mean "every interface", so
    127.0.0.1 is asked."""
    port = os.environ.get("PORT") or dotenv_value("PORT") or "8000"
    host = os.environ.get("HOST_BIND") or dotenv_value("HOST_BIND") or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/v1"


def api_key_from(args) -> str | None:
    return args.api_key or os.environ.get(API_KEY_ENV) or os.environ.get("OPENAI_API_KEY") or None


# --------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------


@dataclasses.dataclass
class StreamResult:
    """One streamed request, timed on the client with time.perf_counter()."""

    ok: bool
    status: int
    t_start: float                 # request sent
    t_first: float | None = None   # first chunk that carries output text
    chunk_times: list = dataclasses.field(default_factory=list)  # every output chunk
    text: str = ""                 # content
    reasoning: str = ""            # reasoning_content / reasoning
    completion_tokens: int | None = None  # from the usage chunk
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str = ""
    t_end: float | None = None
    # Assembled from the streamed tool_call deltas, OpenAI-style:
    # [{"id", "type", "function": {"name", "arguments"}}] in index order.
    tool_calls: list = dataclasses.field(default_factory=list)
    usage: dict | None = None      # the usage chunk as sent

    @property
    def cached_tokens(self) -> int | None:
        """usage.prompt_tokens_details.cached_tokens (vLLM sends it with
        --enable-prompt-tokens-details), else None."""
        return cached_tokens_of(self.usage)

    @property
    def e2e(self) -> float | None:
        """Request sent -> stream ended (end-to-end latency)."""
        return None if self.t_end is None else self.t_end - self.t_start

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output chunks (one token each without
        speculative decoding; with MTP a chunk can carry several tokens)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def n_tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return len(self.chunk_times)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first / time after the first (the stream's decode rate)."""
        if len(self.chunk_times) < 2 or self.n_tokens < 2:
            return None
        dt = self.chunk_times[-1] - self.chunk_times[0]
        return (self.n_tokens - 1) / dt if dt > 0 else None


class Client:
    def __init__(self, base_url: str = DEFAULT_BASE_URL, api_key: str | None = None,
                 timeout: float = 1800.0):
        u = urllib.parse.urlsplit(base_url.rstrip("/"))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ClientError(f"base URL {base_url!r}: give it as http://HOST:PORT/v1")
        self.base_url = base_url.rstrip("/")
        self.scheme, self.host = u.scheme, u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path  # usually "/v1"
        # vLLM serves /health, /metrics and /tokenize at the root, not under /v1.
        self.root_prefix = self.prefix[:-3] if self.prefix.endswith("/v1") else self.prefix
        self.api_key = api_key
        self.timeout = timeout

    # -- plumbing ----------------------------------------------------------

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)

    def _headers(self, extra: dict | None = None) -> dict:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        if extra:
            h.update(extra)
        return h

    def url(self, path: str, root: bool = False) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.root_prefix if root else self.prefix}{path}"

    def request(self, method: str, path: str, body: dict | None = None, root: bool = False,
                timeout: float | None = None) -> tuple[int, bytes]:
        """One request; returns (status, body). Connection errors -> status 0."""
        timeout = self.timeout if timeout is None else timeout
        full = (self.root_prefix if root else self.prefix) + path
        conn = self._conn(timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, full, body=data, headers=self._headers())
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as e:
            return 0, f"{type(e).__name__}: {e}".encode()
        finally:
            conn.close()

    def post_json(self, path: str, body: dict, timeout: float | None = None) -> tuple[int, dict | None, str]:
        """(status, parsed JSON or None, raw text)."""
        status, raw = self.request("POST", path, body, timeout=timeout)
        text = raw.decode("utf-8", errors="replace")
        try:
            return status, json.loads(text), text
        except ValueError:
            return status, None, text

    # -- endpoints ---------------------------------------------------------

    def health(self, timeout: float = 5.0) -> bool:
        status, _ = self.request("GET", "/health", root=True, timeout=timeout)
        return status == 200

    def wait_healthy(self, deadline_s: float, interval: float = 2.0, log=None) -> bool:
        t_end = time.monotonic() + deadline_s
        while time.monotonic() < t_end:
            if self.health():
                return True
            if log:
                log(f"waiting for {self.url('/health', root=True)} ...")
            time.sleep(min(interval, max(0.0, t_end - time.monotonic())))
        return self.health()

    def metrics(self) -> dict[str, float] | None:
        """Prometheus text from /metrics, summed over label sets; None if absent."""
        status, raw = self.request("GET", "/metrics", root=True, timeout=10.0)
        if status != 200:
            return None
        return parse_prometheus(raw.decode("utf-8", errors="replace"))

    def preemptions(self) -> float | None:
        m = self.metrics()
        if m is None:
            return None
        for name in PREEMPTION_METRICS:
            if name in m:
                return m[name]
        return None

    def tokenize(self, model: str, text: str) -> int | None:
        """Token count from the server's /tokenize (vLLM), or None if it has none."""
        status, raw = self.request("POST", "/tokenize", {"model": model, "prompt": text,
                                                         "add_special_tokens": False},
                                   root=True, timeout=120.0)
        if status != 200:
            return None
        try:
            d = json.loads(raw)
        except ValueError:
            return None
        if isinstance(d.get("count"), int):
            return d["count"]
        if isinstance(d.get("tokens"), list):
            return len(d["tokens"])
        return None

    def stream_chat(self, body: dict, timeout: float | None = None) -> StreamResult:
        """POST /chat/completions with stream=True; time every output chunk.

        Bounded: the socket read timeout and the total deadline are both
        `timeout`; a server that stops sending ends the request with an error.
        """
        timeout = self.timeout if timeout is None else timeout
        body = dict(body, stream=True)
        body.setdefault("stream_options", {"include_usage": True})
        conn = self._conn(timeout)
        t0 = time.perf_counter()
        res = StreamResult(ok=False, status=0, t_start=t0)
        deadline = t0 + timeout
        try:
            conn.request("POST", self.prefix + "/chat/completions", body=json.dumps(body).encode(),
                         headers=self._headers({"Accept": "text/event-stream"}))
            resp = conn.getresponse()
            res.status = resp.status
            if resp.status != 200:
                res.error = resp.read(4096).decode("utf-8", errors="replace")
                return res
            text_parts, reason_parts = [], []
            calls: dict[int, dict] = {}
            while True:
                if time.perf_counter() > deadline:
                    res.error = f"deadline of {timeout:.0f} s passed while streaming"
                    return res
                line = resp.readline()
                if not line:
                    break  # connection closed
                now = time.perf_counter()
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    res.ok = True
                    break
                try:
                    ev = json.loads(payload)
                except ValueError:
                    res.error = f"bad SSE payload: {payload[:200]!r}"
                    return res
                if ("error" in ev or ev.get("object") == "error") and not ev.get("choices"):
                    # vLLM reports a failure after the 200 header as an error event.
                    res.error = json.dumps(ev.get("error", ev))[:500]
                    return res
                usage = ev.get("usage")
                if usage:
                    res.usage = usage
                    res.completion_tokens = usage.get("completion_tokens", res.completion_tokens)
                    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                got = False
                for ch in ev.get("choices") or []:
                    delta = ch.get("delta") or {}
                    c = delta.get("content")
                    r = delta.get("reasoning_content") or delta.get("reasoning")
                    if c:
                        text_parts.append(c)
                        got = True
                    if r:
                        reason_parts.append(r)
                        got = True
                    if delta.get("tool_calls"):
                        got = True
                        merge_tool_call_deltas(calls, delta["tool_calls"])
                    if ch.get("finish_reason"):
                        res.finish_reason = ch["finish_reason"]
                if got:
                    if res.t_first is None:
                        res.t_first = now
                    res.chunk_times.append(now)
            res.text = "".join(text_parts)
            res.reasoning = "".join(reason_parts)
            res.tool_calls = [calls[i] for i in sorted(calls)]
            if not res.ok and not res.error:
                res.error = "stream ended without [DONE]"
            return res
        except (OSError, http.client.HTTPException) as e:
            res.error = f"{type(e).__name__}: {e}"
            return res
        finally:
            res.t_end = time.perf_counter()
            conn.close()


def merge_tool_call_deltas(calls: dict[int, dict], deltas: list) -> None:
    """Fold streamed tool_call deltas into calls[index] as an OpenAI client
    does: id/type/name from the first delta that has them, arguments
    concatenated."""
    for d in deltas:
        c = calls.setdefault(int(d.get("index", len(calls))),
                             {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        c["id"] = d.get("id") or c["id"]
        fn = d.get("function") or {}
        c["function"]["name"] += fn.get("name") or ""
        c["function"]["arguments"] += fn.get("arguments") or ""


def cached_tokens_of(usage: dict | None) -> int | None:
    """usage.prompt_tokens_details.cached_tokens, or None when absent."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    v = details.get("cached_tokens")
    return v if isinstance(v, int) else None


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def connect(args) -> "Client | None":
    """The Client for --base-url/--api-key/--timeout, checked against the
    server; None (after printing the reason) when the server is not usable."""
    client = Client(args.base_url, api_key_from(args), timeout=args.timeout)
    try:
        check_server(client)
    except ClientError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return client


def check_server(client: Client, what: str = "server") -> None:
    """Fail early with a message that says what to do."""
    status, raw = client.request("GET", "/models", timeout=15.0)
    if status == 0:
        raise ClientError(f"cannot reach {client.url('/models')} ({raw.decode()}): is the {what} up? "
                          "start it (docker compose up -d vllm) or pass --base-url")
    if status in (401, 403):
        raise ClientError(f"{client.url('/models')} answered {status}: set {API_KEY_ENV} (or --api-key) "
                          "to the server's API key")
    if status != 200:
        raise ClientError(f"{client.url('/models')} answered {status}: {raw[:300].decode(errors='replace')}")


def served_models(client: Client) -> list[str] | None:
    """The ids /v1/models lists, or None when it cannot be read."""
    status, raw = client.request("GET", "/models", timeout=15.0)
    if status != 200:
        return None
    try:
        return [m.get("id") for m in json.loads(raw).get("data") or [] if isinstance(m, dict)]
    except (ValueError, AttributeError):
        return None


def check_model(client: Client, model: str) -> None:
    """Fail before the run when the server does not serve `model` (else every
    request would answer 404)."""
    ids = served_models(client)
    if ids is not None and model not in ids:
        raise ClientError(f"the server does not serve model {model!r}; it serves: "
                          f"{', '.join(map(str, ids)) or 'nothing'}. Pass --model with one of those "
                          "(or set $OPENAI_MODEL)")


# --------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------

# Short, common lowercase English words: each is one token (with its leading
# space) in the Qwen-family BPE vocabularies, so the text costs about
# TOKENS_PER_WORD tokens per word (sentence-final periods and capitals add the
# rest). Measured on /tokenize when the server has it; this is the fallback.
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this be are had "
    "not or have but one all were which she their there an been has when who will more no "
    "if out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three "
    "small large house water light river stone field road north south east west garden "
    "window table letter music paper story morning evening summer winter city country"
).split()
TOKENS_PER_WORD = 1.15  # estimate for _WORDS text (lowercase words + ". " + capitals)
INSTRUCTION = "Continue the text above for as long as you can."


def filler_words(seed: int, n_words: int) -> list[str]:
    """Deterministic pseudo-prose; filler_words(s, n) is a prefix of filler_words(s, m) for n < m."""
    rng = random.Random(f"vllm-3x3090 filler {seed}")
    out: list[str] = []
    sentence_left = 0
    while len(out) < n_words:
        if sentence_left == 0:
            sentence_left = rng.randint(6, 16)
            w = rng.choice(_WORDS).capitalize()
        else:
            w = rng.choice(_WORDS)
        sentence_left -= 1
        if sentence_left == 0:
            w += "."
        out.append(w)
    return out


def filler_text(seed: int, n_words: int) -> str:
    words = filler_words(seed, n_words)
    # A paragraph break every 80 words keeps lines a realistic length.
    return "\n\n".join(" ".join(words[i:i + 80]) for i in range(0, len(words), 80))


def words_for_tokens(n_tokens: int, seed: int = 0, count_tokens=None, tolerance: float = 0.01) -> tuple[int, int | None]:
    """Word count of filler_text that makes about n_tokens tokens.

    count_tokens(text) -> int | None is the server's /tokenize; with it the
    count is corrected up to 4 times until within `tolerance`. Returns
    (n_words, measured tokens, or None when only TOKENS_PER_WORD estimated).
    """
    if n_tokens <= 0:
        return 0, 0
    n_words = max(1, int(round(n_tokens / TOKENS_PER_WORD)))
    measured = None
    for _ in range(4):
        measured = count_tokens(filler_text(seed, n_words)) if count_tokens else None
        if measured is None or abs(measured - n_tokens) <= tolerance * n_tokens:
            break
        n_words = max(1, int(round(n_words * n_tokens / max(1, measured))))
    return n_words, measured


def prompt_text(seed: int, n_words: int, head: str = "") -> str:
    """head + filler + INSTRUCTION; n_words == 0 gives the instruction alone
    (a "0-token" prompt: only the chat template's and the instruction's tokens)."""
    parts = [head] if head else []
    if n_words > 0:
        parts.append(filler_text(seed, n_words))
    parts.append(INSTRUCTION)
    return "\n\n".join(parts)


def build_prompt(n_tokens: int, seed: int, count_tokens=None, tolerance: float = 0.01) -> tuple[str, int | None]:
    """Filler of about n_tokens tokens + INSTRUCTION: (prompt, measured filler tokens or None)."""
    n_words, measured = words_for_tokens(n_tokens, seed, count_tokens, tolerance)
    return prompt_text(seed, n_words), measured


# --------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------


def median(xs) -> float | None:
    xs = sorted(xs)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def percentile(xs, q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def summarize(xs) -> dict:
    xs = [x for x in xs if x is not None]
    return {"n": len(xs), "median": median(xs), "p90": percentile(xs, 90), "mean": mean(xs),
            "min": min(xs) if xs else None, "max": max(xs) if xs else None}


# --------------------------------------------------------------------------
# JSON schema (the subset structured-output requests use)
# --------------------------------------------------------------------------


def validate(instance, schema: dict, path: str = "$") -> list[str]:
    """Errors of `instance` against `schema` (type, properties, required,
    enum, items, additionalProperties=false, minItems/maxItems). Empty = valid."""
    errs: list[str] = []
    t = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    if t == "integer":
        ok = isinstance(instance, int) and not isinstance(instance, bool)
    elif t == "number":
        ok = isinstance(instance, (int, float)) and not isinstance(instance, bool)
    elif t in types:
        ok = isinstance(instance, types[t])
    else:
        ok = True
    if not ok:
        return [f"{path}: expected {t}, got {type(instance).__name__}"]
    if "enum" in schema and instance not in schema["enum"]:
        errs.append(f"{path}: {instance!r} not in {schema['enum']}")
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in instance:
                errs.append(f"{path}: missing required {k!r}")
        for k, v in instance.items():
            if k in props:
                errs.extend(validate(v, props[k], f"{path}.{k}"))
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: unexpected property {k!r}")
    if isinstance(instance, list):
        if "items" in schema:
            for i, v in enumerate(instance):
                errs.extend(validate(v, schema["items"], f"{path}[{i}]"))
        if len(instance) < schema.get("minItems", 0):
            errs.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(instance) > schema["maxItems"]:
            errs.append(f"{path}: more than {schema['maxItems']} items")
    return errs


def write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def stable_int(s: str) -> int:
    """A seed from a string, the same in every process (hash() is salted)."""
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:6], "little")


def json_arg(s: str):
    """argparse type: a JSON value, or @FILE holding one."""
    if s.startswith("@"):
        with open(s[1:]) as f:
            s = f.read()
    try:
        return json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e


def fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


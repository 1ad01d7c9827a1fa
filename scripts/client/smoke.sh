#!/usr/bin/env bash
# smoke.sh: a quick real-hardware check of the image on the user's GPUs.
#
# Starts the server with --load-format dummy (random weights: no 60+ GiB
# checkpoint read) and a small --max-model-len, waits for /health, sends one
# chat request and one structured-output (json_schema) request, prints the
# gates line ("vllm-3x3090 patches (N): ...") from the server log, and stops
# the server again. Exit 0 only if both requests answered 200 (and the
# structured answer is JSON, unless the dummy weights ran into max_tokens).
#
# The PLE table: compose mounts $PLE_TABLE and the server checks its size
# (102,400,491,520 B for this model) before loading. Dummy weights never need
# its contents, so by default the smoke run mounts a sparse stand-in of that
# size (no disk space, no extraction first); SMOKE_PLE_TABLE=/path/to/table
# mounts a real one instead. Only MODEL_DIR (config.json + tokenizer) is read.
#
# Usage: scripts/client/smoke.sh [--direct] [--dry-run] [--help]
#   default   `docker compose run` of the `vllm` service (its GPUs, mounts and
#             env), with the service's own command (from `docker compose config`)
#             plus the smoke overrides appended (vLLM takes the last value of a
#             repeated flag)
#   --direct  `vllm serve` on this host (needs SMOKE_MODEL)
#   --dry-run print the commands, start nothing
#
# Environment (all optional):
#   VLLM_API_KEY        API key: the server reads it, requests send it as Bearer
#   SMOKE_PORT          host port (default 8001, so a running production server on 8000 is not hit)
#   SMOKE_MAX_MODEL_LEN default 8192
#   SMOKE_TIMEOUT       seconds to wait for /health (default 1200)
#   SMOKE_MODEL         model dir (direct mode; compose mode: overrides the service's)
#   SMOKE_SERVE_ARGS    serve arguments to use instead of the service's command
#   SMOKE_EXTRA_ARGS    more serve arguments appended (e.g. "--kv-cache-memory-bytes 300000000")
#   SMOKE_MODEL_NAME    served model name (default qwen3.8-flash-next)
#   COMPOSE             compose command (default "docker compose"; e.g. podman-compose)
#   CONTAINER_CLI       docker or podman (default docker), for logs/stop
#   SMOKE_COMPOSE_FILES compose files (default compose.yaml), space separated
#   SMOKE_PLE_TABLE     compose mode: the table file to mount (default: a sparse
#                       stand-in in the work dir, since dummy weights read no row)
#   SMOKE_PLE_BYTES     size of the sparse stand-in (default 102400491520)
set -euo pipefail

MODE=compose
DRY=0
for a in "$@"; do
  case "$a" in
    --direct) MODE=direct ;;
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,41p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "smoke.sh: unknown argument $a (see --help)" >&2; exit 2 ;;
  esac
done

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"   # the repo root (compose.yaml)
PORT="${SMOKE_PORT:-8001}"
LEN="${SMOKE_MAX_MODEL_LEN:-8192}"
TIMEOUT="${SMOKE_TIMEOUT:-1200}"
NAME="${SMOKE_MODEL_NAME:-qwen3.8-flash-next}"
COMPOSE="${COMPOSE:-docker compose}"
CLI="${CONTAINER_CLI:-docker}"
FILES="${SMOKE_COMPOSE_FILES:-compose.yaml}"
CONTAINER="vllm-smoke-$$"
BASE="http://127.0.0.1:${PORT}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/vllm-smoke.XXXXXX")"
LOG="$WORK/server.log"
PY="$(command -v python3 || true)"
SERVER_PID=""
STARTED=0

say() { printf '%s\n' "$*"; }
die() { say "smoke: FAIL: $*" >&2; exit 1; }
show() { printf '+'; printf ' %q' "$@"; printf '\n'; }

cleanup() {
  if [[ $MODE == compose && $STARTED == 1 ]]; then
    say "smoke: stopping $CONTAINER"
    "${stop_cmd[@]}" >/dev/null 2>&1 || true
  elif [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    say "smoke: stopping server pid $SERVER_PID"
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    if kill -0 "$SERVER_PID" 2>/dev/null; then kill -9 "$SERVER_PID" 2>/dev/null || true; fi
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

compose_f=()
for f in $FILES; do compose_f+=(-f "$f"); done
read -r -a compose_cmd <<<"$COMPOSE"

# --- the serve arguments ---------------------------------------------------
serve_args=()
if [[ -n "${SMOKE_SERVE_ARGS:-}" ]]; then
  read -r -a serve_args <<<"$SMOKE_SERVE_ARGS"
elif [[ $MODE == direct ]]; then
  [[ -n "${SMOKE_MODEL:-}" ]] || die "--direct needs SMOKE_MODEL=/path/to/the/model/dir (config.json and tokenizer; weights are not read)"
  serve_args=("$SMOKE_MODEL" --served-model-name "$NAME" --pipeline-parallel-size 3 --tensor-parallel-size 1)
else
  [[ -n "$PY" ]] || die "python3 is needed to read the service's command; or set SMOKE_SERVE_ARGS"
  if ! cfg="$(cd "$HERE" && "${compose_cmd[@]}" "${compose_f[@]}" config --format json 2>"$WORK/config.err")"; then
    die "'$COMPOSE ${compose_f[*]} config --format json' failed ($(head -c 300 "$WORK/config.err")); set SMOKE_SERVE_ARGS to the serve arguments"
  fi
  mapfile -t serve_args < <(printf '%s' "$cfg" | "$PY" -c '
import json, sys
cmd = json.load(sys.stdin)["services"]["vllm"].get("command") or []
if isinstance(cmd, str):
    import shlex; cmd = shlex.split(cmd)
print("\n".join(cmd))')
  [[ ${#serve_args[@]} -gt 0 ]] || die "the vllm service has no command in ${FILES}; set SMOKE_SERVE_ARGS"
  if [[ -n "${SMOKE_MODEL:-}" ]]; then serve_args[0]="$SMOKE_MODEL"; fi
fi
listen_port=$PORT
[[ $MODE == compose ]] && listen_port=8000
serve_args+=(--load-format dummy --max-model-len "$LEN" --port "$listen_port")
[[ $MODE == direct ]] && serve_args+=(--host 127.0.0.1)
if [[ -n "${SMOKE_EXTRA_ARGS:-}" ]]; then read -r -a extra <<<"$SMOKE_EXTRA_ARGS"; serve_args+=("${extra[@]}"); fi

PLE_BYTES="${SMOKE_PLE_BYTES:-102400491520}"
STANDIN=""
if [[ $MODE == compose ]]; then
  if [[ -n "${SMOKE_PLE_TABLE:-}" ]]; then
    [[ $DRY == 1 || -f "$SMOKE_PLE_TABLE" ]] || die "SMOKE_PLE_TABLE=$SMOKE_PLE_TABLE: no such file"
    ple_file="$SMOKE_PLE_TABLE"
  else
    STANDIN="$WORK/ple-standin.bin"
    ple_file="$STANDIN"
  fi
  # compose reads PLE_TABLE from the environment before .env
  start_cmd=(env "PLE_TABLE=$ple_file" "${compose_cmd[@]}" "${compose_f[@]}" run --rm -d --name "$CONTAINER" -p "127.0.0.1:${PORT}:8000" vllm "${serve_args[@]}")
  logs_cmd=("$CLI" logs "$CONTAINER")
  stop_cmd=("$CLI" stop -t 30 "$CONTAINER")
else
  start_cmd=(vllm serve "${serve_args[@]}")
fi

if [[ $DRY == 1 ]]; then
  say "# smoke plan ($MODE mode): start, wait for $BASE/health (up to ${TIMEOUT} s), chat + json_schema request, gates line, stop"
  if [[ -n "$STANDIN" ]]; then
    say "# PLE table: a sparse stand-in of $PLE_BYTES bytes (dummy weights read no row; SMOKE_PLE_TABLE=FILE for a real one)"
    show truncate -s "$PLE_BYTES" "$STANDIN"
  fi
  show "${start_cmd[@]}"
  if [[ $MODE == compose ]]; then show "${logs_cmd[@]}"; show "${stop_cmd[@]}"; fi
  exit 0
fi


server_log() {
  if [[ $MODE == compose ]]; then "${logs_cmd[@]}" 2>&1 || true; else cat "$LOG" 2>/dev/null || true; fi
}
alive() {
  if [[ $MODE == compose ]]; then
    [[ "$("$CLI" inspect -f '{{.State.Running}}' "$CONTAINER" 2>/dev/null || echo false)" == true ]]
  else
    kill -0 "$SERVER_PID" 2>/dev/null
  fi
}

if [[ $MODE == compose ]] && [[ -n "$(cd "$HERE" && "${compose_cmd[@]}" "${compose_f[@]}" ps -q vllm 2>/dev/null)" ]]; then
  die "the vllm service is running and holds the GPUs: stop it first ($COMPOSE down)"
fi

if [[ -n "$STANDIN" ]]; then
  say "smoke: PLE table: a sparse stand-in of $PLE_BYTES bytes at $STANDIN (no disk space; dummy weights read no row)"
  truncate -s "$PLE_BYTES" "$STANDIN" 2>/dev/null ||
    die "could not make a sparse $PLE_BYTES-byte file in $WORK (set TMPDIR to a filesystem with sparse files, or SMOKE_PLE_TABLE to the real table)"
fi
show "${start_cmd[@]}"
if [[ $MODE == compose ]]; then
  (cd "$HERE" && "${start_cmd[@]}") >"$LOG" 2>&1 || { cat "$LOG" >&2; die "could not start the container"; }
  STARTED=1
else
  "${start_cmd[@]}" >"$LOG" 2>&1 &
  SERVER_PID=$!
fi

auth=()
[[ -n "${VLLM_API_KEY:-}" ]] && auth=(-H "Authorization: Bearer ${VLLM_API_KEY}")

say "smoke: waiting for $BASE/health (up to ${TIMEOUT} s)"
t0=$SECONDS
until curl -fsS -m 5 -o /dev/null "$BASE/health" 2>/dev/null; do
  alive || { server_log | tail -n 40 >&2; die "the server exited before it was healthy (log tail above)"; }
  (( SECONDS - t0 < TIMEOUT )) || { server_log | tail -n 40 >&2; die "not healthy after ${TIMEOUT} s"; }
  sleep 2
done
say "smoke: healthy after $((SECONDS - t0)) s"

post() {  # post PATH BODY OUT -> prints the HTTP status
  curl -sS -m 300 -o "$3" -w '%{http_code}' "${auth[@]}" -H 'Content-Type: application/json' \
    -d "$2" "$BASE/v1$1" || echo 000
}

chat='{"model":"'"$NAME"'","messages":[{"role":"user","content":"Say hello in one sentence."}],"max_tokens":16,"temperature":0}'
code=$(post /chat/completions "$chat" "$WORK/chat.json")
[[ $code == 200 ]] || { cat "$WORK/chat.json" >&2; die "chat request answered HTTP $code"; }
say "smoke: chat OK (HTTP 200)"

schema='{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"],"additionalProperties":false}'
structured='{"model":"'"$NAME"'","messages":[{"role":"user","content":"Reply with a JSON object {\"ok\": true}."}],"max_tokens":64,"temperature":0,"response_format":{"type":"json_schema","json_schema":{"name":"smoke","schema":'"$schema"',"strict":true}}}'
code=$(post /chat/completions "$structured" "$WORK/structured.json")
[[ $code == 200 ]] || { cat "$WORK/structured.json" >&2; die "structured-output request answered HTTP $code"; }
if [[ -n "$PY" ]]; then
  verdict=$("$PY" - "$WORK/structured.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
ch = d["choices"][0]
try:
    json.loads(ch["message"]["content"] or "")
    print("json")
except ValueError:
    print("length" if ch.get("finish_reason") == "length" else "bad")
EOF
)
  case "$verdict" in
    json) say "smoke: structured output OK (HTTP 200, valid JSON)" ;;
    length) say "smoke: structured output HTTP 200; content cut at max_tokens (dummy weights), not checked" ;;
    *) cat "$WORK/structured.json" >&2; die "structured output is not JSON" ;;
  esac
else
  say "smoke: structured output OK (HTTP 200; python3 absent, JSON not checked)"
fi

gates="$(server_log | grep 'vllm-3x3090 patches' | tail -n 1 || true)"
if [[ -n "$gates" ]]; then
  say "smoke: vllm-3x3090 patches${gates#*vllm-3x3090 patches}"
else
  say "smoke: WARNING: no 'vllm-3x3090 patches' line in the server log (unpatched image, or VLLM_PATCH_GATES_LOG=0)"
fi
say "smoke: PASS"

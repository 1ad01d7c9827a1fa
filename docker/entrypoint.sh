#!/usr/bin/env bash
# vllm-3x3090 entrypoint: say which patches this image carries and which are
# switched on (the same line the engine logs at start), refuse the placeholder
# API key, then exec the server.
set -euo pipefail
python3 - <<'PY' || echo "vllm-3x3090: could not read the patch manifest" >&2
import importlib.util, json, pathlib
# The manifest is read without importing vllm (that pulls in torch, seconds);
# only the gates line needs vllm.envs for the declared defaults.
spec = importlib.util.find_spec("vllm")
path = pathlib.Path(spec.origin).parent / "_vllm_3x3090" / "manifest.json" if spec else None
if path is None:
    print("vllm-3x3090: vllm is not installed in this python3")
elif not path.is_file():
    print(f"vllm-3x3090: no manifest at {path}: this vllm is unpatched")
else:
    m = json.loads(path.read_text())
    print(f"vllm-3x3090: {m['base']}, {len(m['series'])} patches (manifest {path})")
    for e in m["series"]:
        print(f"  {e['name']}  sha256 {e['sha256'][:16]}  gate {e['gate']}")
    try:
        from vllm.patch_gates import format_gates_line, gate_states
    except Exception as e:  # e.g. a build stage without torch
        print(f"vllm-3x3090: gate states unknown: import vllm failed ({type(e).__name__}: {e})")
    else:
        print(format_gates_line(gate_states(m)))
PY
if [ "${1:-}" = "--" ]; then shift; fi
case "${1:-}" in
  bash|sh|python3|python) exec "$@" ;;
  vllm) [ "${2:-}" = serve ] || exec "$@" ;;
esac
# .env.example ships VLLM_API_KEY=change-me; serving with it (above all with
# HOST_BIND=0.0.0.0) would let anyone who read the README in.
if [ "${VLLM_API_KEY:-}" = change-me ]; then
  echo "vllm-3x3090: refusing to serve with the placeholder VLLM_API_KEY=change-me from .env.example." >&2
  echo "  Set VLLM_API_KEY in .env to a key of your own, e.g. the output of:" >&2
  echo "  python3 -c \"import secrets; print(secrets.token_urlsafe(32))\"" >&2
  exit 64
fi
if [ "${1:-}" = vllm ]; then exec "$@"; fi
exec vllm serve "$@"

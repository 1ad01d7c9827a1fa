#!/usr/bin/env bash
# vllm-3x3090 entrypoint: say which patches this image carries and which are
# switched on (the same line the engine logs at start), then exec the server.
set -euo pipefail
python3 - <<'PY' || echo "vllm-3x3090: could not read the patch manifest" >&2
from vllm.patch_gates import MANIFEST_PATH, format_gates_line, gate_states, read_manifest
m = read_manifest()
if m is None:
    print(f"vllm-3x3090: no manifest at {MANIFEST_PATH}: this vllm is unpatched")
else:
    print(f"vllm-3x3090: {m['base']}, {len(m['series'])} patches (manifest {MANIFEST_PATH})")
    for e in m["series"]:
        print(f"  {e['name']}  sha256 {e['sha256'][:16]}  gate {e['gate']}")
    print(format_gates_line(gate_states(m)))
PY
if [ "${1:-}" = "--" ]; then shift; fi
case "${1:-}" in
  bash|sh|python3|python|vllm) exec "$@" ;;
esac
exec vllm serve "$@"

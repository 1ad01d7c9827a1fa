#!/usr/bin/env python3
"""A stand-in for `docker compose` in the ab.py tests: records every call, acts out a few.

Environment:
  FAKE_COMPOSE_LOG       file to append one JSON line per call (argv)
  FAKE_COMPOSE_GATES     comma list of the gates the fake image has
  FAKE_COMPOSE_MANIFEST  file printed by `exec ... python3 -c ...` (the installed manifest)
  FAKE_COMPOSE_ITL       JSON {gate: itl seconds} used while that gate is "0" (else FAKE_COMPOSE_ITL_BASE)
  FAKE_COMPOSE_ITL_FILE  where the current ITL is written on `up` (the fake server reads it)
  FAKE_COMPOSE_TTFT      JSON {gate: ttft seconds} used while that gate is "0" (else FAKE_COMPOSE_TTFT_BASE)
  FAKE_COMPOSE_TTFT_FILE where the current TTFT is written on `up`
  FAKE_COMPOSE_FAIL_UP   a gate: `up` with it set to "0" fails
  FAKE_COMPOSE_FATAL     a gate: `up` with it "0" makes the server unhealthy for good
                         (FAKE_COMPOSE_UNHEALTHY_FILE) and `logs` print an engine start failure
  FAKE_COMPOSE_STUCK     a gate the fake server keeps "on" whatever the override says
"""

import json
import os
import re
import sys


def overrides(argv):
    env = {}
    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-f"]
    for f in files:
        if os.path.exists(f) and "override" in os.path.basename(f):
            for k, v in re.findall(r'^\s+(VLLM_[A-Z0-9_]+): "(.*)"$', open(f).read(), re.M):
                env[k] = v
    return env


def main():
    argv = sys.argv[1:]
    with open(os.environ["FAKE_COMPOSE_LOG"], "a") as f:
        f.write(json.dumps(argv) + "\n")
    env = overrides(argv)
    off = {g for g, v in env.items() if v in ("0", "")}
    sub = next(a for a in argv if a in ("up", "logs", "exec"))
    fatal = os.environ.get("FAKE_COMPOSE_FATAL") in off
    if sub == "up":
        if os.environ.get("FAKE_COMPOSE_FAIL_UP") in off:
            print("fake compose: container failed to start", file=sys.stderr)
            return 1
        uf = os.environ.get("FAKE_COMPOSE_UNHEALTHY_FILE")
        if uf:
            if fatal:
                open(uf, "w").close()
            elif os.path.exists(uf):
                os.unlink(uf)
        itl = float(os.environ.get("FAKE_COMPOSE_ITL_BASE", "0.005"))
        for g, v in json.loads(os.environ.get("FAKE_COMPOSE_ITL", "{}")).items():
            if g in off:
                itl = v
        with open(os.environ["FAKE_COMPOSE_ITL_FILE"], "w") as f:
            f.write(str(itl))
        if os.environ.get("FAKE_COMPOSE_TTFT_FILE"):
            ttft = float(os.environ.get("FAKE_COMPOSE_TTFT_BASE", "0.01"))
            for g, v in json.loads(os.environ.get("FAKE_COMPOSE_TTFT", "{}")).items():
                if g in off:
                    ttft = v
            with open(os.environ["FAKE_COMPOSE_TTFT_FILE"], "w") as f:
                f.write(str(ttft))
        return 0
    if sub == "logs":
        gates = [g for g in os.environ.get("FAKE_COMPOSE_GATES", "").split(",") if g]
        stuck = os.environ.get("FAKE_COMPOSE_STUCK")
        parts = [f"{i:04d}-p[{g}]={'off' if g in off and g != stuck else 'on'}" for i, g in enumerate(gates)]
        print("INFO 12-02 10:00:00 [core.py:90] some other line")
        if fatal:
            print("ERROR 12-02 10:00:01 [core.py:700] RuntimeError: Engine core initialization failed. "
                  "See root cause above.")
            return 0
        print(f"INFO 12-02 10:00:01 [core.py:129] vllm-3x3090 patches ({len(parts)}): " + " ".join(parts))
        return 0
    if sub == "exec":
        print(open(os.environ["FAKE_COMPOSE_MANIFEST"]).read().replace("\n", " "))
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Per-patch A/B in one build: restart the compose service with one gate off, benchmark, repeat.

Every patch of the series has its own VLLM_* gate (default on; =0 restores the
upstream code path in the same image), so a patch's contribution is measured
the reference's way (the write-up, 3.0: A/B by env var in one build; a fresh
start alone moves the numbers, so each variant is its own restart). For the
baseline (every gate at its default) and then for each gate G:

  1. write an override compose file that sets only G="0" for the service
  2. <compose> -f compose.yaml -f <override> up -d --force-recreate vllm
  3. wait for /health (every --log-check-s the logs are read for an engine
     start failure, so a variant that cannot start is not waited on for
     --health-timeout), then check the server's gates line
     ("vllm-3x3090 patches (N): ...[G]=off") in `<compose> logs`
  4. python3 scripts/client/bench_serving.py --json <work>/<variant>.json ... (the
     arguments after `--`; each variant gets its own --cold-salt, so cold
     prompts are unread on every side)
  5. record the variant as done in <work>/state.json

A variant that fails (compose up, /health, the gates check, the benchmark) is
recorded as failed and the run goes on with the next one; the exit status is
1 when any failed (rerun the same command to retry only those).

At the end the service is restarted without an override (--no-restore keeps
the last variant) and a table (markdown) + a bar chart (PNG) of every
patch's contribution is written, each gate scored on the metric it changes,
per benchmark configuration (+ = the patch helps):
  decode gates          baseline tok/s per stream / gate-off tok/s per stream - 1
  TTFT gates (0150      gate-off TTFT median / baseline TTFT median - 1
  VLLM_PLE_PREFETCH)    (its effect shows on unread prompts: pass --prefix both)

Resumable: a variant recorded in state.json (same env, result file present)
is not run again; rerun the same command after an interruption. --fresh
forgets the state. --report rebuilds the table/plot from the state only.

Where the gates come from (first that applies): --manifest FILE (the JSON
that `scripts/vllm_patches.py apply` writes into vllm/_vllm_3x3090/), --patches
DIR (a patches/ series), else the running container (`<compose> exec -T vllm
python3 -c ...` reads the installed manifest); --dry-run asks no container and
uses this repository's patches/. Skipped unless asked for with --only:
VLLM_PATCH_GATES_LOG (the gates log line itself, which step 3 reads),
VLLM_PINNED_POOL (=0 brings back power-of-two pinned rounding: the ~68 GiB
K/V pool becomes 128 GiB and the server may not start) and opt-in gates
("Gate: VLLM_X (opt-in: ...)": their off state is "unset", which an override
cannot express; give --off-value VLLM_X=VALUE to include one). The MTP-only
gates (0620, 0630, 0640) are skipped unless the compose files enable MTP
(-f compose.yaml -f compose/mtp.yaml).

Every command is printed before it runs; --dry-run prints the plan (the exact
commands, the override files' contents) and runs nothing. The API key is
passed to bench_serving.py through $VLLM_API_KEY, never on a command line.

  python3 scripts/client/ab.py --dry-run -- --concurrency 1,4 --prompt-tokens 0,8192
  python3 scripts/client/ab.py -- --concurrency 1,4 --prompt-tokens 0,8192
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import oai_client as oc

CLIENT = Path(__file__).resolve().parent
SCRIPTS = CLIENT.parent
REPO = SCRIPTS.parent
GATES_LOG_MARK = "vllm-3x3090 patches"
NOT_AB = {
    "VLLM_PATCH_GATES_LOG": "the gates log line itself (ab.py reads it to check each flip)",
    "VLLM_PINNED_POOL": "=0 restores power-of-two pinned rounding (the ~68 GiB K/V pool becomes 128 GiB): "
                        "the server may not start; --only VLLM_PINNED_POOL to try it",
}
# Log lines after which a restarted server never gets healthy (vLLM's engine
# start failures): ab.py stops waiting for that variant at once.
FATAL_MARKS = ("Engine core initialization failed", "CUDA out of memory", "torch.OutOfMemoryError",
               "cudaErrorMemoryAllocation", "EngineDeadError")
# Gates whose code runs only with MTP speculative decoding (compose/mtp.yaml).
NEEDS_MTP = {"VLLM_DRAFT_TOKENS_PER_REQUEST", "VLLM_MTP_PP", "VLLM_MTP_FIT"}
# Gates scored on TTFT (what they change); every other gate on decode tok/s.
TTFT_GATES = {"VLLM_PLE_PREFETCH"}


def needs_mtp(gate: str) -> bool:
    return gate in NEEDS_MTP or gate.startswith("VLLM_MTP_")


def metric_of(variant: str) -> str:
    return "ttft" if variant.split("=")[0] in TTFT_GATES else "decode"

# Run inside the service's container: the installed manifest plus each patch's
# full "Gate:" field (from the patch copies next to it), as one JSON line.
CONTAINER_SNIPPET = r"""
import json, os, re, vllm
d = os.path.join(os.path.dirname(vllm.__file__), "_vllm_3x3090")
m = json.load(open(os.path.join(d, "manifest.json")))
for e in m.get("series", []):
    try:
        head = open(os.path.join(d, e["name"]), encoding="utf-8").read().split("\ndiff --git ", 1)[0]
        g = re.search(r"^Gate:(.*)$", head, re.M)
        e["gate_field"] = g.group(1).strip() if g else ""
    except OSError:
        pass
print(json.dumps(m))
""".strip()


class ABError(Exception):
    pass


# --------------------------------------------------------------------------
# Manifest -> gates
# --------------------------------------------------------------------------


def gate_field_from_patch(path: Path) -> str:
    try:
        head = path.read_text(encoding="utf-8").split("\ndiff --git ", 1)[0]
    except OSError:
        return ""
    m = re.search(r"^Gate:(.*)$", head, re.M)
    return m.group(1).strip() if m else ""


def manifest_from_patches(patch_dir: Path) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    import vllm_patches

    try:
        patches = vllm_patches.load_series(patch_dir)
    except vllm_patches.PatchError as e:
        raise ABError(str(e)) from e
    return {"series": [{"name": p.name, "sha256": p.sha256, "gate": p.gate,
                        "gate_field": p.fields.get("Gate", ""),
                        "description": p.fields.get("Description", "").split("\n")[0],
                        "files": [fp.path for fp in p.files]} for p in patches]}


def gates_of(manifest: dict, patch_dir: Path | None = None) -> list[dict]:
    """[{gate, patches:[names], opt_in, description}] in series order, one per gate."""
    out: dict[str, dict] = {}
    for e in manifest.get("series", []):
        gate = e.get("gate") or ""
        if not gate:
            continue
        field = e.get("gate_field")
        if field is None and patch_dir is not None:
            field = gate_field_from_patch(patch_dir / e["name"])
        g = out.setdefault(gate, {"gate": gate, "patches": [], "opt_in": False,
                                  "description": e.get("description", "")})
        g["patches"].append(e["name"])
        g["opt_in"] = g["opt_in"] or "opt-in" in (field or "")
    return list(out.values())


def plan_variants(gates: list[dict], only: list[str], skip: list[str], off_values: dict[str, str],
                  mtp: bool = True):
    """([(variant name, env overrides)], [(gate, reason skipped)]). mtp: the
    compose files run MTP speculative decoding (else MTP-only gates cannot apply)."""
    variants = [("baseline", {})]
    skipped = []
    known = {g["gate"] for g in gates}
    for name in only + skip + list(off_values):
        if name not in known:
            raise ABError(f"{name} is not a gate of this series (gates: {', '.join(sorted(known)) or 'none'})")
    for name in only:
        if needs_mtp(name) and not mtp:
            raise ABError(f"{name} only acts with MTP speculative decoding, which these compose files do "
                          "not enable: add -f compose.yaml -f compose/mtp.yaml")
    for g in gates:
        name = g["gate"]
        if only and name not in only:
            skipped.append((name, "not in --only"))
            continue
        if name in skip:
            skipped.append((name, "--skip"))
            continue
        if needs_mtp(name) and not mtp:
            skipped.append((name, "acts only with MTP speculative decoding, which these compose files do "
                                  "not enable (-f compose.yaml -f compose/mtp.yaml to A/B it)"))
            continue
        if name in off_values:
            variants.append((f"{name}={off_values[name]}", {name: off_values[name]}))
            continue
        if name in NOT_AB and name not in only:
            skipped.append((name, NOT_AB[name]))
            continue
        if g["opt_in"]:
            skipped.append((name, "opt-in gate: off means unset; give --off-value "
                                  f"{name}=VALUE to A/B it"))
            continue
        variants.append((f"{name}=0", {name: "0"}))
    return variants, skipped


def compose_uses_mtp(project: Path, files: list[str]) -> bool:
    """Whether the compose files' command enables speculative decoding (read as text)."""
    for f in files:
        p = Path(f) if Path(f).is_absolute() else project / f
        try:
            text = p.read_text()
        except OSError:
            continue
        if "--speculative-config" in text or "speculative_config" in text:
            return True
    return False


def override_yaml(service: str, variant: str, env: dict[str, str]) -> str:
    lines = [f"# generated by scripts/client/ab.py for variant {variant}", "services:", f"  {service}:",
             "    environment:"]
    lines += [f"      {k}: {json.dumps(v)}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def variant_slug(variant: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", variant)


def parse_gates_line(line: str) -> dict[str, bool]:
    """'vllm-3x3090 patches (2): 0010-x[VLLM_A]=on 0020-y[VLLM_B]=off' -> {VLLM_A: True, VLLM_B: False}."""
    return {g: s == "on" for g, s in re.findall(r"\[(VLLM_[A-Z0-9_]+)\]=(on|off)", line)}


# --------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------


class AB:
    def __init__(self, args, bench_args: list[str]):
        self.args = args
        self.compose = shlex.split(args.compose_cmd)
        self.files = args.compose_file or ["compose.yaml"]
        self.project = Path(args.project_directory).resolve()
        self.work = Path(args.work_dir).resolve()
        self.service = args.service
        self.bench_args = bench_args
        self.state_path = self.work / "state.json"
        self.client = oc.Client(args.base_url, oc.api_key_from(args), timeout=30)

    # -- commands ----------------------------------------------------------

    def compose_cmd(self, override: Path | None, *tail: str) -> list[str]:
        cmd = list(self.compose)
        for f in self.files:
            cmd += ["-f", f]
        if override is not None:
            cmd += ["-f", str(override)]
        return cmd + list(tail)

    def up_cmd(self, override: Path | None) -> list[str]:
        return self.compose_cmd(override, "up", "-d", "--force-recreate", self.service)

    def logs_cmd(self, override: Path | None) -> list[str]:
        return self.compose_cmd(override, "logs", "--no-color", self.service)

    def bench_cmd(self, variant: str) -> list[str]:
        slug = variant_slug(variant)
        return [sys.executable, str(CLIENT / "bench_serving.py"),
                "--base-url", self.args.base_url, "--model", self.args.model,
                "--label", variant, "--cold-salt", slug,
                "--json", str(self.work / f"{slug}.json")] + self.bench_args

    def override_path(self, variant: str, env: dict) -> Path | None:
        return self.work / f"override-{variant_slug(variant)}.yaml" if env else None

    # -- state -------------------------------------------------------------

    def load_state(self) -> dict:
        if self.args.fresh or not self.state_path.exists():
            return {"version": 1, "variants": {}}
        try:
            return json.loads(self.state_path.read_text())
        except ValueError as e:
            raise ABError(f"{self.state_path}: {e}; fix it or pass --fresh") from e

    def is_done(self, state: dict, variant: str, env: dict) -> bool:
        v = state["variants"].get(variant)
        return bool(v and not v.get("failed") and v.get("env") == env and v.get("bench_args") == self.bench_args
                    and Path(v.get("json", "")).exists())

    # -- manifest ----------------------------------------------------------

    def manifest(self) -> tuple[dict, Path | None, str]:
        a = self.args
        if a.manifest:
            try:
                m = json.loads(Path(a.manifest).read_text())
            except (OSError, ValueError) as e:
                raise ABError(f"--manifest {a.manifest}: {e}") from e
            return m, Path(a.patches) if a.patches else REPO / "patches", f"file {a.manifest}"
        if a.patches:
            return manifest_from_patches(Path(a.patches)), None, f"series in {a.patches}"
        if a.dry_run:
            return (manifest_from_patches(REPO / "patches"), None,
                    f"this repository's series ({REPO / 'patches'}; a dry run asks no container: "
                    "--manifest/--patches for another image's)")
        cmd = self.compose_cmd(None, "exec", "-T", self.service, "python3", "-c", CONTAINER_SNIPPET)
        print(f"# reading the installed manifest from the running {self.service} container:")
        print(shlex.join(cmd[:-1]) + " '<snippet>'")
        r = subprocess.run(cmd, cwd=self.project, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise ABError(f"could not read the manifest from the container ({r.stderr.strip()[:300]}); "
                          f"start it (`{shlex.join(self.up_cmd(None))}`) or pass --manifest FILE / --patches DIR")
        try:
            return json.loads(r.stdout.strip().splitlines()[-1]), None, f"container {self.service}"
        except (ValueError, IndexError) as e:
            raise ABError(f"the container printed no manifest JSON: {r.stdout[:300]}") from e

    # -- plan / run ----------------------------------------------------------

    def plan(self):
        m, patch_dir, source = self.manifest()
        gates = gates_of(m, patch_dir)
        off = {}
        for kv in self.args.off_value or []:
            k, sep, v = kv.partition("=")
            if not sep:
                raise ABError(f"--off-value {kv!r}: give GATE=VALUE")
            off[k] = v
        only = [g for x in self.args.only or [] for g in x.split(",") if g]
        skip = [g for x in self.args.skip or [] for g in x.split(",") if g]
        variants, skipped = plan_variants(gates, only, skip, off,
                                          mtp=compose_uses_mtp(self.project, self.files))
        return variants, skipped, source, gates

    def print_plan(self, variants, skipped, source, state) -> None:
        print(f"# ab.py plan: {len(variants)} variants (baseline + {len(variants) - 1} gates off), "
              f"gates from {source}")
        print(f"# work dir {self.work} (state {self.state_path}), project dir {self.project}")
        for g, why in skipped:
            print(f"# skipped {g}: {why}")
        ttft = [v for v, env in variants if env and metric_of(v) == "ttft"]
        if ttft and not any(a in ("cold", "both") for a in self.bench_args):
            print(f"# note: {', '.join(ttft)} is scored on TTFT, which it changes on unread prompts: "
                  "pass `-- --prefix both` (or cold) to measure it")
        for i, (variant, env) in enumerate(variants, 1):
            done = self.is_done(state, variant, env)
            print(f"\n## [{i}/{len(variants)}] {variant}" + ("  [done: skipped on resume]" if done else ""))
            ov = self.override_path(variant, env)
            if ov is not None:
                print(f"cat > {shlex.quote(str(ov))} <<'EOF'\n{override_yaml(self.service, variant, env)}EOF")
            print(shlex.join(self.up_cmd(ov)))
            print(f"# wait for {self.client.url('/health', root=True)} (up to {self.args.health_timeout:.0f} s)")
            print(f"{shlex.join(self.logs_cmd(ov))} | grep {shlex.quote(GATES_LOG_MARK)} | tail -n 1")
            print(shlex.join(self.bench_cmd(variant)))
        if not self.args.no_restore:
            print("\n## restore (every gate at its default)")
            print(shlex.join(self.up_cmd(None)))

    def sh(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        print("+ " + shlex.join(cmd), flush=True)
        return subprocess.run(cmd, cwd=self.project, **kw)

    def gates_line(self, override: Path | None) -> str | None:
        r = self.sh(self.logs_cmd(override), capture_output=True, text=True, timeout=300)
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if GATES_LOG_MARK in ln]
        return lines[-1] if lines else None

    def fatal_line(self, override: Path | None) -> str | None:
        """A log line that says the server will never get healthy, or None."""
        r = subprocess.run(self.logs_cmd(override), cwd=self.project, capture_output=True, text=True,
                           timeout=300)
        for ln in (r.stdout + r.stderr).splitlines():
            if any(m in ln for m in FATAL_MARKS):
                return ln.strip()
        return None

    def wait_healthy(self, variant: str, override: Path | None) -> None:
        """Until /health answers, reading the logs every --log-check-s for a start
        failure (the engine dies long before --health-timeout runs out)."""
        t_end = time.monotonic() + self.args.health_timeout
        next_check = time.monotonic() + self.args.log_check_s
        while True:
            if self.client.health():
                return
            now = time.monotonic()
            if now >= t_end:
                raise ABError(f"{variant}: not healthy after {self.args.health_timeout:.0f} s; "
                              f"see `{shlex.join(self.logs_cmd(override))}`")
            if now >= next_check:
                next_check = now + self.args.log_check_s
                line = self.fatal_line(override)
                if line:
                    raise ABError(f"{variant}: the server failed to start ({line[:300]}); "
                                  f"see `{shlex.join(self.logs_cmd(override))}`")
            time.sleep(max(0.0, min(5.0, t_end - now, next_check - now)))

    def run_variant(self, variant: str, env: dict) -> dict:
        ov = self.override_path(variant, env)
        if ov is not None:
            ov.write_text(override_yaml(self.service, variant, env))
            print(f"wrote {ov}:\n{ov.read_text()}", end="")
        if self.sh(self.up_cmd(ov)).returncode != 0:
            raise ABError(f"{variant}: compose up failed (see above)")
        print(f"waiting for {self.client.url('/health', root=True)} (up to {self.args.health_timeout:.0f} s)")
        # Give the old container's port a moment to close before the first probe.
        time.sleep(self.args.settle_s)
        self.wait_healthy(variant, ov)
        line = self.gates_line(ov)
        if line is None:
            print(f"warning: no '{GATES_LOG_MARK}' line in the {self.service} logs; cannot check the gates")
        else:
            print(line)
            states = parse_gates_line(line)
            for g in env:
                if states.get(g, True) and env[g] in ("0", ""):
                    raise ABError(f"{variant}: the server reports {g} on after setting it to {env[g]!r}: "
                                  f"check {ov}")
        child_env = dict(os.environ)
        if self.args.api_key:
            child_env[oc.API_KEY_ENV] = self.args.api_key
        cmd = self.bench_cmd(variant)
        if self.sh(cmd, env=child_env).returncode != 0:
            raise ABError(f"{variant}: bench_serving.py failed (see above); rerun to resume")
        return {"env": env, "bench_args": self.bench_args, "json": cmd[cmd.index("--json") + 1],
                "gates_line": line,
                "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}

    def run(self) -> int:
        variants, skipped, source, _ = self.plan()
        state = self.load_state()
        if self.args.dry_run:
            self.print_plan(variants, skipped, source, state)
            return 0
        if not self.args.report:
            self.work.mkdir(parents=True, exist_ok=True)
            self.print_plan(variants, skipped, source, state)
            print()
            failed = []
            try:
                for variant, env in variants:
                    if self.is_done(state, variant, env):
                        print(f"== {variant}: done earlier ({state['variants'][variant]['json']})")
                        continue
                    print(f"== {variant}")
                    try:
                        state["variants"][variant] = self.run_variant(variant, env)
                    except ABError as e:
                        # Go on with the next variant; a rerun retries this one.
                        print(f"error: {e}; going on with the next variant", file=sys.stderr)
                        failed.append(variant)
                        state["variants"][variant] = {
                            "env": env, "bench_args": self.bench_args, "failed": str(e),
                            "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                timespec="seconds")}
                    oc.write_json(str(self.state_path), state)
            finally:
                if not self.args.no_restore:
                    print("== restore")
                    self.sh(self.up_cmd(None))
            rc = self.report(variants, state)
            if failed:
                print(f"error: {len(failed)} variant(s) failed: {', '.join(failed)} (see above; rerun the same "
                      "command to retry only those)", file=sys.stderr)
                return 1
            return rc
        return self.report(variants, state)

    def report(self, variants, state) -> int:
        res = {}
        for variant, _env in variants:
            v = state["variants"].get(variant)
            if v and not v.get("failed") and Path(v.get("json", "")).exists():
                res[variant] = json.loads(Path(v["json"]).read_text())
        failed = {v: state["variants"][v]["failed"] for v, _ in variants
                  if state["variants"].get(v, {}).get("failed")}
        if "baseline" not in res:
            print("no baseline result yet: nothing to report")
            return 1
        text, contrib = report_table(res)
        if failed:
            text += "\n\nfailed variants (no result):\n" + "\n".join(f"- {v}: {why}" for v, why in failed.items())
        print(text)
        (self.work / "ab-report.md").write_text(text + "\n")
        oc.write_json(str(self.work / "ab-report.json"), {
            "tool": "scripts/client/ab.py", "contributions": contrib,
            "metrics": {v: metric_of(v) for v in res if v != "baseline"}, "failed": failed,
            "variants": {k: v["results"] for k, v in res.items()}})
        import tinypng

        gates = [v for v in res if v != "baseline"]
        if gates and contrib:
            cfgs = sorted({c for v in contrib.values() for c in v})
            backend = tinypng.bar_chart(
                [g.split("=")[0].removeprefix("VLLM_") + (" (TTFT)" if metric_of(g) == "ttft" else "")
                 for g in gates],
                {c: [contrib.get(g, {}).get(c) for g in gates] for c in cfgs},
                str(self.work / "ab-contrib.png"), title="patch contribution (+ = the patch helps)",
                ylabel="% decode tok/s base/off - 1; TTFT off/base - 1")
            print(f"wrote {self.work / 'ab-report.md'}, ab-report.json, ab-contrib.png ({backend})")
        else:
            print(f"wrote {self.work / 'ab-report.md'}, ab-report.json")
        return 0


def cfg_key(r: dict) -> str:
    return f"{r['prompt_tokens']}/{r['prefix']}/x{r['concurrency']}"


def contribution(variant: str, base: dict, off: dict) -> float | None:
    """% by which the patch helps, on the gate's own metric (decode tok/s or TTFT)."""
    if metric_of(variant) == "ttft":
        b, o = base["ttft_s"]["median"], off["ttft_s"]["median"]
        return (o / b - 1) * 100 if b and o else None
    b, o = base["tok_s_per_stream_mean"], off["tok_s_per_stream_mean"]
    return (b / o - 1) * 100 if b and o else None


def report_table(res: dict[str, dict]) -> tuple[str, dict]:
    base = {cfg_key(r): r["summary"] for r in res["baseline"]["results"]}
    rows = ["| variant | scored on | prompt/prefix/streams | tok/s per stream | TTFT median s | patch contribution "
            "| ITL median ms | total tok/s |", "|---|---|---|---|---|---|---|---|"]
    contrib: dict[str, dict] = {}
    for variant, d in res.items():
        for r in d["results"]:
            k, s = cfg_key(r), r["summary"]
            c = None
            b = base.get(k)
            if variant != "baseline" and b:
                c = contribution(variant, b, s)
                if c is not None:
                    contrib.setdefault(variant, {})[k] = c
            metric = "" if variant == "baseline" else ("TTFT" if metric_of(variant) == "ttft" else "decode tok/s")
            rows.append(f"| {variant} | {metric} | {k} | {oc.fmt(s['tok_s_per_stream_mean'])} | "
                        f"{oc.fmt(s['ttft_s']['median'], '.3f')} | "
                        f"{'' if variant == 'baseline' else oc.fmt(c, '+.1f') + ' %'} | "
                        f"{oc.fmt(s['itl_ms']['median'], '.2f')} | {oc.fmt(s['total_tok_s_mean'])} |")
    return "\n".join(rows), contrib


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s [options] [-- bench_serving.py options]")
    oc.add_common_args(ap)
    ap.add_argument("--manifest", help="manifest.json (as `vllm_patches.py apply` writes it)")
    ap.add_argument("--patches", help="patches/ dir: the series (alone), or where --manifest's patch "
                                      "headers are looked up (default: this repo's patches/)")
    ap.add_argument("--compose-cmd", default="docker compose", help="e.g. 'podman-compose' (default: %(default)s)")
    ap.add_argument("-f", "--compose-file", action="append", help="base compose file(s) (default: compose.yaml)")
    ap.add_argument("--project-directory", default=str(REPO), help="where compose runs (default: the repo root)")
    ap.add_argument("--service", default="vllm")
    ap.add_argument("--work-dir", default="ab-work", help="overrides, results, state.json (default: %(default)s)")
    ap.add_argument("--only", action="append", help="only these gates (comma list; repeatable)")
    ap.add_argument("--skip", action="append", help="skip these gates")
    ap.add_argument("--off-value", action="append", metavar="GATE=VALUE",
                    help="A/B GATE with this value instead of 0 (needed for opt-in gates)")
    ap.add_argument("--health-timeout", type=float, default=1800.0,
                    help="seconds to wait for /health after a restart (default %(default)s: the model load)")
    ap.add_argument("--log-check-s", type=float, default=30.0,
                    help="while waiting for /health, read the logs this often for a start failure "
                         "(default %(default)s)")
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="seconds to wait after `up` before probing /health (default %(default)s)")
    ap.add_argument("--no-restore", action="store_true", help="leave the last variant running")
    ap.add_argument("--fresh", action="store_true", help="ignore state.json (run every variant again)")
    ap.add_argument("--report", action="store_true", help="only rebuild the table and plot from state.json")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the exact commands; run nothing")
    args = ap.parse_args(argv)
    try:
        return AB(args, bench_args).run()
    except ABError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

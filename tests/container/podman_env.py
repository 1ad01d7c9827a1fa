"""Container runtime for tests/container: podman 4.3 + runc, a stand-in base image,
and `podman run` arguments derived from the merged compose configuration.

Why these choices (measured on Debian 12 machines like CI's, as root):
- podman 4.3 with crun fails on hybrid cgroups here; runc works given
  containers.conf `default_ulimits = []` (podman's default nofile ulimit
  is refused) and `cgroup_manager = "cgroupfs"` (no systemd).
- No image registry is reachable, so the base image is a stand-in: a debootstrap
  minbase root with python3 and the pristine vllm 0.30.0 wheel's files (no
  torch). The project's Dockerfile builds on it through VLLM_IMAGE, so its
  real apply and `apply --check` steps run in a real image build.
- podman-compose 1.0.3 (Debian 12) appends the `command` lists of two compose
  files instead of replacing them (docker compose replaces), which breaks
  compose.yaml + compose/mtp.yaml. So `merged_service` merges with docker
  compose's rules (command/entrypoint/image replaced, environment merged by
  name, volumes merged by container path, cap_add/ports appended) and
  `run_args` turns the service into `podman run` arguments.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# Bump when the stand-in base image's recipe changes (it is cached by tag).
RECIPE = "1"
CONTAINERS_CONF = """\
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "runc"
"""


class Unavailable(Exception):
    """podman cannot run containers on this machine (the test skips, or fails in CI)."""


def log(msg: str) -> None:
    print(f"[container-test] {msg}", file=sys.stderr, flush=True)


def conf_env() -> dict:
    d = Path(tempfile.gettempdir()) / "vllm-3x3090-container-test"
    d.mkdir(exist_ok=True)
    conf = d / "containers.conf"
    if not conf.exists() or conf.read_text() != CONTAINERS_CONF:
        conf.write_text(CONTAINERS_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(*args: str, check: bool = True, input: bytes | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(["podman", "--runtime", "runc", *args], env=conf_env(), input=input,
                       capture_output=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... exited {r.returncode}:\n"
                           f"{r.stdout.decode(errors='replace')[-3000:]}\n"
                           f"{r.stderr.decode(errors='replace')[-3000:]}")
    return r


TOOLS = ("podman", "runc", "debootstrap", "podman-compose")  # commands = Debian package names


def ensure_tools() -> None:
    """podman, runc, debootstrap, podman-compose; apt-get installs them when missing (root only)."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(missing)} missing and no root apt-get to install them "
                          f"(apt-get install {' '.join(TOOLS)})")
    log(f"installing {' '.join(missing)} with apt-get (about 40 s)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    r = subprocess.run(cmd, env=env, capture_output=True)
    if r.returncode != 0:  # fresh machine: empty package lists
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        r = subprocess.run(cmd, env=env, capture_output=True)
    if r.returncode != 0:
        raise Unavailable(f"apt-get install {' '.join(missing)} failed:\n{r.stderr.decode()[-2000:]}")


def debian_mirror() -> tuple[str, str]:
    """(mirror URL, suite) of this machine's own apt configuration."""
    suite = ""
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            suite = line.split("=", 1)[1].strip('"')
    texts = [p.read_text() for p in sorted(Path("/etc/apt").glob("sources.list.d/*.sources"))]
    for t in texts:  # deb822: the stanza whose suites include the release itself
        for stanza in t.split("\n\n"):
            f = dict(re.findall(r"^(\w+):\s*(.+)$", stanza, re.M))
            if "deb" in f.get("Types", "").split() and suite in f.get("Suites", "").split():
                return f["URIs"].split()[0], suite
    lists = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt").glob("sources.list.d/*.list"))]
    for p in lists:
        if p.exists():
            m = re.search(rf"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+{suite}\s", p.read_text(), re.M)
            if m:
                return m.group(1), suite
    raise Unavailable("no Debian apt source for debootstrap found in /etc/apt")


def base_image() -> str:
    """The stand-in for vllm/vllm-openai: Debian minbase + python3 + pristine vllm 0.30.0."""
    import vllm_patches as vp

    whl = vp.fetch_wheel(log=log)
    mirror, suite = debian_mirror()
    key = hashlib.sha256(f"{RECIPE} {suite} {vp.sha256_file(whl)}".encode()).hexdigest()[:12]
    tag = f"localhost/vllm-3x3090-standin-base:{key}"
    if podman("image", "exists", tag, check=False).returncode == 0:
        log(f"base image {tag} cached")
        return tag
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="vllm3x-rootfs-") as tmp:
        root = Path(tmp) / "root"
        log(f"debootstrap {suite} minbase + python3 (about 3 minutes)")
        r = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3", suite, str(root),
                            mirror], capture_output=True)
        if r.returncode != 0:
            raise Unavailable(f"debootstrap failed:\n{r.stdout.decode()[-2000:]}{r.stderr.decode()[-2000:]}")
        (pyver,) = {p.name for p in (root / "usr/lib").glob("python3.[0-9]*") if p.is_dir()}
        site = root / "usr/local/lib" / pyver / "dist-packages"
        site.mkdir(parents=True, exist_ok=True)
        vp.unpack_pristine(site, whl)
        for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / d, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        r = subprocess.run(["podman", "--runtime", "runc", "import", "--change", 'CMD ["/bin/bash"]',
                            "-", tag], stdin=tar.stdout, env=conf_env(), capture_output=True)
        tar.wait()
        if r.returncode != 0:
            raise Unavailable(f"podman import failed: {r.stderr.decode()[-2000:]}")
    log(f"base image {tag} built in {time.time() - t0:.0f} s")
    return tag


def check_runs(image: str) -> None:
    r = podman("run", "--rm", image, "python3", "-c", "print('ok')", check=False, timeout=120)
    if r.returncode != 0 or r.stdout.strip() != b"ok":
        raise Unavailable(f"podman cannot run a container here: {r.stderr.decode()[-2000:]}")


# --------------------------------------------------------------------------
# compose: docker compose's merge and interpolation, for the keys our files use

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict):
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m):
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        val = env.get(name)
        unset = val is None or (op is not None and op.startswith(":") and val == "")
        if op and op.endswith("?") and unset:
            raise ValueError(f"required variable {name} is missing a value: {arg}")
        if op and op.endswith("-") and unset:
            return arg
        return val or ""

    return _VAR.sub(sub, value)


def volume_target(v: str) -> str:
    """Container path of a short-syntax volume (the source may hold ${VAR:?...})."""
    parts = v.rsplit(":", 2)
    return parts[-2] if len(parts) == 3 and parts[-1] in ("ro", "rw", "z", "Z") else v.rsplit(":", 1)[-1]


def _merge_service(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if k not in out:
            out[k] = v
        elif k == "environment":
            out[k] = {**out[k], **v}
        elif k == "volumes":  # by container path
            target = {volume_target(s): s for s in out[k]}
            target.update({volume_target(s): s for s in v})
            out[k] = list(target.values())
        elif k in ("cap_add", "ports", "devices", "security_opt"):
            out[k] = out[k] + [x for x in v if x not in out[k]]
        elif isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = _merge_service(out[k], v)
        else:  # command, entrypoint, image, scalars: replaced
            out[k] = v
    return out


def merged_service(files: list[Path], env: dict, service: str = "vllm") -> dict:
    svc: dict = {}
    for f in files:
        svc = _merge_service(svc, yaml.safe_load(f.read_text())["services"][service])
    return interpolate(svc, env)


def memlock_hard_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]


_MEMLOCK_OK: dict[str, bool] = {}


def memlock_unlimited_ok(image: str) -> bool:
    """Whether runc can give a container `memlock: -1` here. On these machines
    (hard limit 8 MiB) runc's setrlimit(RLIMIT_MEMLOCK) is refused with EPERM
    for any value, even a lower one, so compose's ulimit must be left out."""
    if image not in _MEMLOCK_OK:
        r = podman("run", "--rm", "--entrypoint", "true", "--ulimit", "memlock=-1:-1", image,
                   check=False, timeout=120)
        _MEMLOCK_OK[image] = r.returncode == 0
    return _MEMLOCK_OK[image]


def run_args(svc: dict, name: str, image: str | None = None,
             memlock_ok: bool | None = None) -> tuple[list[str], list[str]]:
    """(`podman run` arguments, what was left out and why) for one compose service."""
    handled = {"image", "build", "restart", "ipc", "cap_add", "ulimits", "deploy", "devices",
               "security_opt", "ports", "volumes", "environment", "healthcheck", "command"}
    if set(svc) - handled:  # a new compose key must be mapped here, not dropped silently
        raise ValueError(f"run_args does not map compose key(s) {sorted(set(svc) - handled)}")
    args = ["-d", "--name", name]
    left = ["build (the test builds the image itself)"]
    if svc.get("restart"):
        left.append(f"restart: {svc['restart']} (a restart would hide the exit status the test checks)")
    if svc.get("ipc"):
        args += ["--ipc", svc["ipc"]]
    for c in svc.get("cap_add", []):
        args += ["--cap-add", c]
    for k, v in (svc.get("ulimits") or {}).items():
        if k == "memlock" and not (memlock_ok if memlock_ok is not None else
                                   memlock_unlimited_ok(image or svc["image"])):
            left.append(f"ulimits memlock={v} (runc's setrlimit is refused here; this machine's "
                        f"hard limit is {memlock_hard_limit()} B)")
            continue
        args += ["--ulimit", f"{k}={v}:{v}" if not isinstance(v, dict) else f"{k}={v['soft']}:{v['hard']}"]
    if svc.get("deploy"):
        left.append("deploy.resources GPU reservation (no GPU here)")
    for d in svc.get("devices", []):
        left.append(f"device {d} (no GPU here)")
    for s in svc.get("security_opt", []):
        args += ["--security-opt", s]
    for p in svc.get("ports", []):
        args += ["-p", p]
    for v in svc.get("volumes", []):
        args += ["-v", v]
    for k, v in (svc.get("environment") or {}).items():
        args += ["-e", f"{k}={v}"]
    hc = svc.get("healthcheck")
    if hc:
        # podman 4.3 splits a JSON array that starts with "CMD" at whitespace
        # (strings.Fields); an array without it is taken as exec form, and
        # ["CMD-SHELL", s] as it is. No timer (no systemd here): the test
        # calls `podman healthcheck run`.
        test = hc["test"]
        cmd = json.dumps(test[1:]) if test[0] == "CMD" else json.dumps(test)
        args += ["--health-cmd", cmd, "--health-interval", "disable",
                 "--health-retries", str(hc.get("retries", 3)), "--health-timeout", hc.get("timeout", "30s")]
    args += [image or svc["image"], *svc.get("command", [])]
    return args, left

"""The image and the compose services in a real container runtime (podman + runc).

(a) The project's Dockerfile is built by `podman build` on a stand-in base
    (Debian + python3 + the pristine vllm 0.30.0 wheel's files, no torch; see
    podman_env.py) through its VLLM_IMAGE build argument: the real apply and
    `apply --check` steps run in a real image build.
(b) The vllm service of compose.yaml, and of compose.yaml + compose/mtp.yaml,
    runs from the built image with a stand-in `vllm` (standin_vllm.py) added
    on top, so the real entrypoint execs `vllm serve <the compose command>`
    into a small OpenAI server that loads the mounted checkpoint. Checked:
    every mount resolves (read-only, same bytes; the MTP overlay's symlinks
    into the checkpoint mount), the environment and command reach the process,
    capabilities and IPC namespace, the published port, the key check, the
    healthcheck command (by `podman healthcheck run`), the placeholder key
    refused at start, nothing created in the checkpoint directory.
(c) compose.yaml through podman-compose itself (its .env, interpolation,
    network and healthcheck translation).

Not covered here: GPUs (deploy.resources / compose/podman.yaml's CDI device),
`ulimits: memlock` where runc cannot set it (on these machines its
setrlimit(RLIMIT_MEMLOCK) is refused for any value; the test says what it left
out), the real server and torch. Skipped when podman cannot run containers on the machine;
with CI=true that is a failure instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

import vllm_patches as vp
import podman_env as pe

pytestmark = pytest.mark.skipif(not Path("/proc/self/ns/user").exists(), reason="no Linux namespaces")

IMAGE = "localhost/vllm-3x3090:container-test"
STANDIN = "localhost/vllm-3x3090:container-test-standin"
CKPT = "/models/qwen3.8-flash-next"


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but the container runtime is unavailable: {reason}")
    pytest.skip(f"container runtime unavailable: {reason}")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    t0 = time.time()
    try:
        pe.ensure_tools()
        base = pe.base_image()
        pe.check_runs(base)
    except pe.Unavailable as e:
        unavailable(str(e))
    # The previous run's images go first, and --layers=false keeps no
    # intermediate images, so repeated runs leave nothing behind; --no-cache:
    # the apply and check steps run (and print) on every test run.
    pe.podman("rmi", "-f", STANDIN, IMAGE, check=False)
    r = pe.podman("build", "--no-cache", "--layers=false", "--build-arg", f"VLLM_IMAGE={base}",
                  "-t", IMAGE, "-f",
                  str(pe.REPO / "Dockerfile"), str(pe.REPO))
    build_log = r.stdout.decode() + r.stderr.decode()
    ctx = tmp_path_factory.mktemp("standin-layer")
    shutil.copy(pe.HERE / "standin_vllm.py", ctx / "vllm")
    (ctx / "Containerfile").write_text(f"FROM {IMAGE}\nCOPY vllm /usr/local/bin/vllm\n"
                                       "RUN chmod 755 /usr/local/bin/vllm\n")
    pe.podman("build", "--layers=false", "-t", STANDIN, str(ctx))
    pe.log(f"images ready in {time.time() - t0:.0f} s")
    return {"base": base, "build_log": build_log}


# -- (a) the image build -----------------------------------------------------

def test_image_build_applies_and_checks_series(images):
    series = [p.name for p in vp.load_series()]
    log = images["build_log"]
    assert f"applied {len(series)} patches to " in log
    assert f"carries the series ({len(series)} patches) unmodified" in log
    # The image's vllm carries the manifest of this checkout's series.
    r = pe.podman("run", "--rm", "--entrypoint", "python3", IMAGE, "-c",
                  "import importlib.util as u, json, pathlib as p;"
                  "print(json.dumps(json.loads((p.Path(u.find_spec('vllm').origin).parent"
                  " / '_vllm_3x3090' / 'manifest.json').read_text())))")
    m = json.loads(r.stdout)
    assert [e["name"] for e in m["series"]] == series
    assert [e["sha256"] for e in m["series"]] == [p.sha256 for p in vp.load_series()]


def test_entrypoint_prints_manifest_and_passes_tools_through(images):
    r = pe.podman("run", "--rm", "-e", "VLLM_API_KEY=change-me", IMAGE, "bash", "-c", "echo tool-ran")
    out = r.stdout.decode()
    n = len(vp.load_series())
    assert f"vllm-3x3090: vllm 0.30.0, {n} patches (manifest " in out or f", {n} patches (manifest " in out
    # No torch in the stand-in base: the gates line says why it is missing.
    assert "gate states unknown: import vllm failed" in out
    assert out.rstrip().endswith("tool-ran")  # the placeholder key only stops serving


# -- (b) the compose services ------------------------------------------------

def write_safetensors(path: Path, tensors: dict[str, bytes]) -> None:
    header, off = {}, 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(tensors.values()))


@pytest.fixture
def host_files(tmp_path):
    """A small checkpoint, a PLE table, and make_mtp_int4.py's output layout:
    real config/index/mtp-int4 files, every other file an absolute symlink
    into the checkpoint's in-container path."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shards = {"model-00001-of-00002.safetensors": "model.layers.0.mlp.w",
              "model-00002-of-00002.safetensors": "model.layers.1.mlp.w"}
    for i, (f, t) in enumerate(shards.items()):
        write_safetensors(ckpt / f, {t: bytes([i + 1]) * 64})
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen4_exp", "from": "checkpoint"}))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {t: f for f, t in shards.items()}}))
    (ckpt / "tokenizer.json").write_text("{}")
    ple = tmp_path / "ple_table.bin"
    ple.write_bytes(os.urandom(4096))
    ovl = tmp_path / "mtp-int4"
    ovl.mkdir()
    (ovl / "config.json").write_text(json.dumps({"model_type": "qwen4_exp", "from": "mtp-overlay"}))
    write_safetensors(ovl / "mtp-int4.safetensors", {"mtp.layers.0.experts.w_packed": b"\x07" * 32})
    wm = {t: f for f, t in shards.items()} | {"mtp.layers.0.experts.w_packed": "mtp-int4.safetensors"}
    (ovl / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    for name in [*shards, "tokenizer.json"]:
        (ovl / name).symlink_to(f"{CKPT}/{name}")
    os.chmod(tmp_path, 0o755)
    return {"ckpt": ckpt, "ple": ple, "overlay": ovl, "shards": shards}


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.is_symlink(), p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(d.rglob("*"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(port: int, path: str, key: str | None, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, {}


# Runs inside the container: what each mount target holds.
PROBE = r"""
import hashlib, json, os, sys
out = {}
for dst in sys.argv[1:]:
    d = {"exists": os.path.exists(dst)}
    if os.path.isdir(dst):
        d["entries"] = {n: {"link": os.readlink(os.path.join(dst, n)) if os.path.islink(os.path.join(dst, n)) else None,
                            "resolves": os.path.exists(os.path.join(dst, n)),
                            "sha256": hashlib.sha256(open(os.path.join(dst, n), "rb").read()).hexdigest()
                                      if os.path.exists(os.path.join(dst, n)) else None}
                        for n in sorted(os.listdir(dst))}
        probe = os.path.join(dst, ".probe")
    elif d["exists"]:
        d["sha256"] = hashlib.sha256(open(dst, "rb").read()).hexdigest()
        probe = dst
    try:
        open(probe, "a").close(); d["write"] = "ok"
    except OSError as e:
        d["write"] = e.strerror
    out[dst] = d
print(json.dumps(out))
"""


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def start(files: list[str], env: dict, name: str) -> tuple[dict, list[str]]:
    svc = pe.merged_service([pe.REPO / f for f in files], env)
    args, left = pe.run_args(svc, name)
    pe.log(f"{' + '.join(files)}: not applied here: {'; '.join(left) or 'nothing'}")
    pe.podman("run", *args)
    return svc, left


def wait_ready(name: str, port: int) -> None:
    for _ in range(120):
        st = pe.podman("inspect", "-f", "{{.State.Status}}", name).stdout.decode().strip()
        if st != "running":
            logs = pe.podman("logs", name, check=False)
            pytest.fail(f"container {st}:\n{logs.stdout.decode()}{logs.stderr.decode()}")
        try:
            if http(port, "/health", None)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail("stand-in server did not answer on the published port within 60 s")


@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "compose/mtp.yaml"],
                                   ["compose.yaml", "compose/podman.yaml"]],
                         ids=["compose", "compose+mtp", "compose+podman"])
def test_service(images, host_files, files):
    mtp = "compose/mtp.yaml" in files
    key, port = secrets.token_urlsafe(16), free_port()
    env = {"MODEL_DIR": str(host_files["ckpt"]), "PLE_TABLE": str(host_files["ple"]),
           "MTP_INT4_DIR": str(host_files["overlay"]), "VLLM_API_KEY": key,
           "HOST_BIND": "127.0.0.1", "PORT": str(port), "VLLM_3X3090_IMAGE": STANDIN}
    before = snapshot(host_files["ckpt"]), snapshot(host_files["overlay"])
    name = f"vllm3x-test-{os.getpid()}-{'mtp' if mtp else 'base'}"
    try:
        svc, _ = start(files, env, name)
        # The merge is docker compose's: the last file's command replaces the
        # others', volumes add up by container path.
        raw = [yaml.safe_load((pe.REPO / f).read_text())["services"]["vllm"] for f in files]
        assert svc["command"] == [r["command"] for r in raw if "command" in r][-1]
        assert sorted(map(pe.volume_target, svc["volumes"])) == sorted(
            {pe.volume_target(v) for r in raw for v in r.get("volumes", [])})
        wait_ready(name, port)

        # The command and the environment reach the server process (pid 1:
        # the entrypoint execs vllm, which is the stand-in).
        cmdline = pe.podman("exec", name, "cat", "/proc/1/cmdline").stdout.split(b"\0")[:-1]
        assert [c.decode() for c in cmdline[2:]] == ["serve", *svc["command"]]
        environ = dict(kv.decode().split("=", 1) for kv in
                       pe.podman("exec", name, "cat", "/proc/1/environ").stdout.split(b"\0") if kv)
        for k, v in svc["environment"].items():
            assert environ.get(k) == str(v), k
        assert environ["VLLM_API_KEY"] == key
        if mtp:
            assert environ["VLLM_PP_LAYER_PARTITION"] == "16,17,15"
            assert svc["command"][0] == "/models/mtp-overlay"

        # Every mount resolves, read-only, with the host's bytes.
        dsts = {pe.volume_target(v): Path(v.split(":")[0]) for v in svc["volumes"]}
        probe = json.loads(pe.podman("exec", name, "python3", "-c", PROBE, *dsts).stdout)
        for dst, src in dsts.items():
            got = probe[dst]
            assert got["exists"] and got["write"] == "Read-only file system", (dst, got)
            if src.is_dir():
                assert set(got["entries"]) == {p.name for p in src.iterdir()}, dst
                for n, e in got["entries"].items():
                    assert e["resolves"], (dst, n, e)
                    assert e["sha256"] == sha(src / n if not (src / n).is_symlink() else
                                              host_files["ckpt"] / n), (dst, n)
            else:
                assert got["sha256"] == sha(src), dst
        if mtp:
            ents = probe["/models/mtp-overlay"]["entries"]
            assert {n for n, e in ents.items() if e["link"]} == {*host_files["shards"], "tokenizer.json"}
            assert all(e["link"] == f"{CKPT}/{n}" for n, e in ents.items() if e["link"])

        # What the server loaded: the model the command names, through the
        # overlay's symlinks for the MTP variant.
        logs = pe.podman("logs", name).stdout.decode()
        line = next(l for l in logs.splitlines() if l.startswith("standin-vllm: {"))
        loaded = json.loads(line.split(": ", 1)[1])
        assert loaded["model"] == svc["command"][0]
        assert loaded["served_model_name"] == "qwen3.8-flash-next" and loaded["auth"]
        assert loaded["config"]["from"] == ("mtp-overlay" if mtp else "checkpoint")
        for f in host_files["shards"]:
            assert loaded["files"][f]["realpath"] == f"{CKPT}/{f}"
            assert loaded["files"][f]["symlink"] == mtp
        if mtp:
            assert loaded["files"]["mtp-int4.safetensors"]["tensors"] == ["mtp.layers.0.experts.w_packed"]
        n = len(vp.load_series())
        assert f", {n} patches (manifest " in logs  # the real entrypoint ran first

        # Capabilities and the host IPC namespace.
        status = pe.podman("exec", name, "cat", "/proc/1/status").stdout.decode()
        cap_eff = int(next(l for l in status.splitlines() if l.startswith("CapEff:")).split()[1], 16)
        assert cap_eff >> 19 & 1 and cap_eff >> 23 & 1  # CAP_SYS_PTRACE, CAP_SYS_NICE
        ipc = pe.podman("exec", name, "readlink", "/proc/1/ns/ipc").stdout.decode().strip()
        assert ipc == os.readlink("/proc/self/ns/ipc")

        # The published port, with the key.
        assert http(port, "/v1/models", None)[0] == 401
        assert http(port, "/v1/models", "wrong")[0] == 401
        code, body = http(port, "/v1/models", key)
        assert code == 200 and body["data"][0]["id"] == "qwen3.8-flash-next"
        code, body = http(port, "/v1/chat/completions", key,
                          {"model": "qwen3.8-flash-next", "messages": [{"role": "user", "content": "hi"}]})
        assert code == 200 and body["choices"]

        # compose's healthcheck, run by podman; and it does fail on a wrong key.
        test = svc["healthcheck"]["test"]
        stored = pe.podman("inspect", "--format", "{{json .Config.Healthcheck.Test}}", name).stdout
        assert json.loads(stored) == test  # compose's command, verbatim
        hc = pe.podman("healthcheck", "run", name, check=False)
        assert hc.returncode == 0, hc.stdout.decode() + hc.stderr.decode()
        argv = ["sh", "-c", test[1]] if test[0] == "CMD-SHELL" else test[1:]
        bad = pe.podman("exec", "-e", "VLLM_API_KEY=wrong", name, *argv, check=False)
        assert bad.returncode != 0 and b"401" in bad.stderr
    finally:
        pe.podman("rm", "-f", "-t", "0", name, check=False)
    # Nothing was created in (or changed on) the host's checkpoint or overlay.
    assert (snapshot(host_files["ckpt"]), snapshot(host_files["overlay"])) == before


def test_placeholder_key_refused_at_start(images, host_files):
    env = {"MODEL_DIR": str(host_files["ckpt"]), "PLE_TABLE": str(host_files["ple"]),
           "VLLM_API_KEY": "change-me", "HOST_BIND": "0.0.0.0", "PORT": str(free_port()),
           "VLLM_3X3090_IMAGE": STANDIN}
    name = f"vllm3x-test-{os.getpid()}-placeholder"
    try:
        start(["compose.yaml"], env, name)
        rc = pe.podman("wait", name, timeout=60).stdout.decode().strip()
        logs = pe.podman("logs", name)
        out = logs.stdout.decode() + logs.stderr.decode()
        assert rc == "64", out
        assert "placeholder VLLM_API_KEY=change-me" in out and "in .env" in out
        assert 'python3 -c "import secrets; print(secrets.token_urlsafe(32))"' in out
        assert "standin-vllm:" not in out  # the server never started
    finally:
        pe.podman("rm", "-f", "-t", "0", name, check=False)


def test_podman_compose_up(images, host_files, tmp_path):
    """compose.yaml through podman-compose itself (1.0.3 on Debian 12), as the
    README's podman users run it: its own .env reading, interpolation, argument
    mapping, network and healthcheck translation. Only the base file:
    podman-compose 1.0.3 appends the `command` lists of two files (see
    compose/mtp.yaml)."""
    key, port = secrets.token_urlsafe(16), free_port()
    proj = tmp_path / "proj"
    proj.mkdir()
    svc_raw = yaml.safe_load((pe.REPO / "compose.yaml").read_text())
    left = []
    if not pe.memlock_unlimited_ok(STANDIN):
        del svc_raw["services"]["vllm"]["ulimits"]
        left.append("ulimits (runc's setrlimit(RLIMIT_MEMLOCK) is refused here)")
        (proj / "compose.yaml").write_text(yaml.safe_dump(svc_raw, sort_keys=False))
    else:
        shutil.copy(pe.REPO / "compose.yaml", proj / "compose.yaml")
    pe.log(f"podman-compose compose.yaml: left out here: {'; '.join(left) or 'nothing'}")
    (proj / ".env").write_text(
        f"MODEL_DIR={host_files['ckpt']}\nPLE_TABLE={host_files['ple']}\nVLLM_API_KEY={key}\n"
        f"HOST_BIND=127.0.0.1\nPORT={port}\nVLLM_3X3090_IMAGE={STANDIN}\n")
    before = snapshot(host_files["ckpt"])
    project = f"vllm3xtest{os.getpid()}"
    name = f"{project}_vllm_1"
    compose = ["podman-compose", "-p", project, "-f", str(proj / "compose.yaml")]
    try:
        r = subprocess.run([*compose, "up", "-d"], cwd=proj, env=pe.conf_env(), capture_output=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
        wait_ready(name, port)
        cmd = svc_raw["services"]["vllm"]["command"]
        cmdline = pe.podman("exec", name, "cat", "/proc/1/cmdline").stdout.split(b"\0")[:-1]
        assert [c.decode() for c in cmdline[2:]] == ["serve", *cmd]
        environ = pe.podman("exec", name, "cat", "/proc/1/environ").stdout.split(b"\0")
        assert f"VLLM_API_KEY={key}".encode() in environ
        assert b"VLLM_PLE_MMAP_PATH=/ple/ple_table.bin" in environ
        assert http(port, "/v1/models", None)[0] == 401
        assert http(port, "/v1/models", key)[0] == 200
        # The healthcheck as podman-compose translated it.
        hc = pe.podman("healthcheck", "run", name, check=False)
        assert hc.returncode == 0, hc.stdout.decode() + hc.stderr.decode()
    finally:
        subprocess.run([*compose, "down", "-t", "0"], cwd=proj, env=pe.conf_env(), capture_output=True,
                       timeout=120)
        pe.podman("rm", "-f", "-t", "0", name, check=False)
        pe.podman("network", "rm", f"{project}_default", check=False)
    assert snapshot(host_files["ckpt"]) == before

"""smoke.sh end to end in --direct mode, with a stand-in `vllm` (the fake server) on PATH."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SMOKE = HERE.parents[1] / "scripts" / "client" / "smoke.sh"

pytestmark = pytest.mark.skipif(shutil.which("curl") is None or shutil.which("bash") is None,
                                reason="smoke.sh needs bash and curl")

GATES = "vllm-3x3090 patches (1): 0010-patch-gates[VLLM_PATCH_GATES_LOG]=on"


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_vllm(tmp_path, startup_delay=1.0, extra=""):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(f"""#!/usr/bin/env bash
echo "$@" > {tmp_path}/argv
port=""; prev=""
for a in "$@"; do [[ $prev == --port ]] && port=$a; prev=$a; done
{extra}
exec {sys.executable} {HERE / 'fake_openai.py'} --port "$port" --api-key "$VLLM_API_KEY" \\
  --startup-delay {startup_delay} --max-seconds 60 --log-gates "INFO 12-02 [core.py:129] {GATES}"
""")
    (bin_dir / "vllm").chmod(0o755)
    return bin_dir


def run_smoke(tmp_path, bin_dir, *args, **env):
    e = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SMOKE_MODEL="/models/q", VLLM_API_KEY="k-1",
             SMOKE_PORT=str(free_port()), SMOKE_TIMEOUT="20", TMPDIR=str(tmp_path))
    e.update(env)
    return subprocess.run(["bash", str(SMOKE), "--direct", *args], env=e, capture_output=True, text=True,
                          timeout=60)


def test_smoke_direct_passes_and_prints_gates(tmp_path):
    bin_dir = fake_vllm(tmp_path)
    r = run_smoke(tmp_path, bin_dir, SMOKE_MAX_MODEL_LEN="4096")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "smoke: chat OK (HTTP 200)" in out
    assert "smoke: structured output OK (HTTP 200, valid JSON)" in out
    assert f"smoke: {GATES}" in out.splitlines()
    lines = out.splitlines()
    assert "smoke: PASS" in lines
    argv = (tmp_path / "argv").read_text().split()
    assert argv[:2] == ["serve", "/models/q"]
    assert argv[argv.index("--load-format") + 1] == "dummy" and argv[argv.index("--max-model-len") + 1] == "4096"
    assert "k-1" not in argv  # the key travels in the environment
    # the server was stopped (after the checks) and the work dir removed
    stop = next(ln for ln in lines if ln.startswith("smoke: stopping server pid "))
    assert lines.index(stop) > lines.index("smoke: PASS")
    pid = int(stop.split()[-1])
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"server pid {pid} still alive")
    assert not list(tmp_path.glob("vllm-smoke.*"))


def test_smoke_fails_when_the_server_dies(tmp_path):
    bin_dir = fake_vllm(tmp_path, extra='echo "CUDA out of memory" >&2; exit 3')
    r = run_smoke(tmp_path, bin_dir)
    assert r.returncode == 1
    assert "exited before it was healthy" in r.stderr and "CUDA out of memory" in r.stderr


def test_smoke_wrong_key_fails(tmp_path):
    bin_dir = fake_vllm(tmp_path, startup_delay=0.2, extra='export VLLM_API_KEY=other')
    r = run_smoke(tmp_path, bin_dir)
    assert r.returncode == 1 and "chat request answered HTTP 401" in r.stderr


def test_smoke_dry_run_compose(tmp_path):
    r = subprocess.run(["bash", str(SMOKE), "--dry-run"], capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, SMOKE_SERVE_ARGS="/models/q --pipeline-parallel-size 3",
                                SMOKE_PORT="8011", TMPDIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    # no PLE table needed: a sparse stand-in of the size the server checks, mounted through PLE_TABLE
    assert "sparse stand-in of 102400491520 bytes" in lines[1]
    standin = lines[2].split()[-1]
    assert lines[2] == f"+ truncate -s 102400491520 {standin}" and standin.endswith("/ple-standin.bin")
    start = lines[3]
    assert start.startswith(f"+ env PLE_TABLE={standin} docker compose -f compose.yaml run --rm -d --name vllm-smoke-")
    assert start.endswith("-p 127.0.0.1:8011:8000 vllm /models/q --pipeline-parallel-size 3 "
                          "--load-format dummy --max-model-len 8192 --port 8000")
    assert not list(tmp_path.glob("vllm-smoke.*"))
    # a real table instead
    r = subprocess.run(["bash", str(SMOKE), "--dry-run"], capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, SMOKE_SERVE_ARGS="/models/q", SMOKE_PLE_TABLE="/srv/nvme/t.bin",
                                TMPDIR=str(tmp_path)))
    assert r.returncode == 0 and "truncate" not in r.stdout
    assert "+ env PLE_TABLE=/srv/nvme/t.bin docker compose" in r.stdout


def test_smoke_compose_mounts_a_sparse_standin_table(tmp_path):
    """Compose mode with a stand-in `docker`: at `compose run` time PLE_TABLE names
    a sparse file of the size the server checks (no disk space used)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f"""#!/usr/bin/env bash
case " $* " in
  *" config "*) echo '{{"services": {{"vllm": {{"command": ["/models/q", "--port", "8000"]}}}}}}' ;;
  *" ps "*) ;;
  *" run "*) stat -c '%s %b %B' "$PLE_TABLE" > {tmp_path}/table; echo "$PLE_TABLE" >> {tmp_path}/table
             echo "fake docker: no GPU here" >&2; exit 1 ;;
esac
""")
    (bin_dir / "docker").chmod(0o755)
    r = subprocess.run(["bash", str(SMOKE)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TMPDIR=str(tmp_path),
                                SMOKE_PORT=str(free_port())))
    assert r.returncode == 1 and "could not start the container" in r.stderr
    size, blocks, block_size, path = (tmp_path / "table").read_text().split()
    assert int(size) == 102400491520 and path.endswith("/ple-standin.bin")
    assert int(blocks) * int(block_size) < 1 << 20  # sparse
    assert not list(tmp_path.glob("vllm-smoke.*"))  # the work dir (and the stand-in) removed

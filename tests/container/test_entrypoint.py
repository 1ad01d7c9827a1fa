"""docker/entrypoint.sh on the host's bash (no container runtime): it refuses
to serve with .env.example's placeholder key, names the fix, and leaves tools
alone. The serving target is a recording `vllm` on PATH."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


@pytest.fixture
def run(tmp_path):
    (tmp_path / "vllm").write_text('#!/bin/sh\necho "vllm-ran $*"\n')
    (tmp_path / "vllm").chmod(0o755)

    def go(*args, key=None):
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
        env["PATH"] = f"{tmp_path}:{env['PATH']}"
        if key is not None:
            env["VLLM_API_KEY"] = key
        return subprocess.run(["bash", str(ENTRYPOINT), *args], env=env, capture_output=True, text=True,
                              timeout=60)
    return go


def test_placeholder_refused_naming_the_fix(run):
    r = run("/models/m", "--port", "8000", key="change-me")
    assert r.returncode == 64
    assert "vllm-ran" not in r.stdout
    assert "VLLM_API_KEY" in r.stderr and ".env" in r.stderr
    # The same generate command .env.example gives.
    gen = re.search(r'Generate one with: (python3 -c ".*")', (REPO / ".env.example").read_text()).group(1)
    assert gen in r.stderr
    assert re.search(r"^VLLM_API_KEY=change-me$", (REPO / ".env.example").read_text(), re.M)


def test_placeholder_refused_for_explicit_vllm_serve(run):
    r = run("vllm", "serve", "/models/m", key="change-me")
    assert r.returncode == 64 and "vllm-ran" not in r.stdout


def test_real_key_serves(run):
    r = run("/models/m", "--port", "8000", key="s3cret-key")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("vllm-ran serve /models/m --port 8000")
    r = run("--", "/models/m", key="s3cret-key")
    assert r.stdout.rstrip().endswith("vllm-ran serve /models/m")


def test_tools_pass_through_with_placeholder(run):
    # Running a tool in the image (bash, python3, `vllm --version`) serves nothing.
    r = run("bash", "-c", "echo tool-ran", key="change-me")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("tool-ran")
    r = run("vllm", "--version", key="change-me")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("vllm-ran --version")

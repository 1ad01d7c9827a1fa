"""Static checks of the image build (no docker engine here): pinned base,
the apply + check step, nothing fetched from the network."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def instructions():
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]


def test_base_image_pinned():
    ins = instructions()
    assert ins[0] == "ARG VLLM_IMAGE=vllm/vllm-openai:v0.30.0"
    assert ins[1] == "FROM ${VLLM_IMAGE}"


def test_apply_then_check():
    run = [i for i in instructions() if i.startswith("RUN")]
    assert len(run) == 1
    cmd = run[0]
    a = cmd.index("vllm_patches.py --patches /opt/vllm-3x3090/patches apply \"$SITE\"")
    c = cmd.index("vllm_patches.py --patches /opt/vllm-3x3090/patches apply --check \"$SITE\"")
    assert a < c
    assert "set -eux" in cmd


def test_copies_what_apply_needs():
    copies = [i for i in instructions() if i.startswith("COPY")]
    srcs = {c.split()[1] for c in copies}
    assert {"patches/", "scripts/vllm_patches.py", "scripts/serve-tools/", "docker/entrypoint.sh"} <= srcs
    for s in srcs:
        assert (REPO / s).exists(), s
    # the client tools, developer tools and bench kits run outside the image
    assert not any(s.rstrip("/") in ("scripts", "scripts/client", "scripts/bench") for s in srcs), srcs


def test_no_network_fetches():
    body = " ".join(instructions())
    for word in ("curl", "wget", "pip install", "pip download", "apt-get", "git clone", "ADD http"):
        assert word not in body, word


def test_apply_tool_is_stdlib_only():
    import ast
    import sys

    tree = ast.parse((REPO / "scripts" / "vllm_patches.py").read_text())
    imports = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imports |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    stdlib = sys.stdlib_module_names
    assert imports - {"__future__"} <= stdlib, imports - stdlib


def test_entrypoint_prints_gates_then_execs_server():
    ep = (REPO / "docker" / "entrypoint.sh").read_text()
    assert "format_gates_line" in ep
    assert ep.rstrip().endswith('exec vllm serve "$@"')
    assert 'ENTRYPOINT ["/opt/vllm-3x3090/entrypoint.sh"]' in DOCKERFILE


def test_dockerignore_keeps_what_the_dockerfile_copies():
    # .dockerignore ignores everything (a .venv of 8 GiB would be sent as the
    # build context) except what COPY names; tests/container builds it for real.
    lines = [l.strip() for l in (REPO / ".dockerignore").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines[0] == "*"
    kept = {l[1:].rstrip("/") for l in lines if l.startswith("!")}
    for c in (i for i in instructions() if i.startswith("COPY")):
        src = c.split()[1].rstrip("/")
        assert src in kept or src.split("/")[0] in kept, src

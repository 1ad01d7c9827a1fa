"""ab.py: the command plan for a manifest (--dry-run), and a full resumable run against a
fake compose command (tests/client/fake_compose.py) and the fake server."""

import json
import shlex
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import ab  # noqa: E402
from fake_openai import FakeConfig, FakeServer  # noqa: E402

MANIFEST = {
    "tool": "vllm-3x3090 scripts/vllm_patches.py", "base": "vllm 0.30.0", "state": "complete",
    "series": [
        {"name": "0010-patch-gates.patch", "sha256": "0" * 64, "gate": "VLLM_PATCH_GATES_LOG",
         "description": "patch gates", "files": ["vllm/envs.py", "vllm/patch_gates.py"]},
        {"name": "0100-ple-mmap.patch", "sha256": "1" * 64, "gate": "VLLM_PLE_MMAP_PATH",
         "gate_field": "VLLM_PLE_MMAP_PATH (opt-in: unset = upstream)", "description": "PLE mmap",
         "files": ["vllm/envs.py"]},
        {"name": "0200-ple-prefetch.patch", "sha256": "2" * 64, "gate": "VLLM_PLE_PREFETCH",
         "description": "prefetch", "files": ["vllm/envs.py"]},
        {"name": "0300-deferred-recv.patch", "sha256": "3" * 64, "gate": "VLLM_PP_DEFERRED_RECV",
         "description": "deferred recv", "files": ["vllm/envs.py"]},
        {"name": "0310-deferred-recv-v2.patch", "sha256": "4" * 64, "gate": "VLLM_PP_DEFERRED_RECV",
         "description": "same gate, second patch", "files": ["vllm/envs.py"]},
    ],
}
GATES = [e["gate"] for e in MANIFEST["series"]]


@pytest.fixture
def manifest(tmp_path):
    p = tmp_path / "manifest.json"
    p.write_text(json.dumps(MANIFEST))
    return p


def test_dry_run_plan_for_manifest(tmp_path, manifest, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "secret-key-123")
    work = tmp_path / "work"
    rc = ab.main(["--manifest", str(manifest), "--dry-run", "--work-dir", str(work),
                  "--", "--concurrency", "1,4", "--prompt-tokens", "0,8k"])
    out = capsys.readouterr().out
    assert rc == 0
    assert not work.exists()  # a dry run writes nothing
    assert "secret-key-123" not in out
    lines = out.splitlines()
    heads = [ln for ln in lines if ln.startswith("## [")]
    assert heads == ["## [1/3] baseline", "## [2/3] VLLM_PLE_PREFETCH=0", "## [3/3] VLLM_PP_DEFERRED_RECV=0"]
    assert any(ln.startswith("# skipped VLLM_PATCH_GATES_LOG:") for ln in lines)
    assert any(ln.startswith("# skipped VLLM_PLE_MMAP_PATH: opt-in") for ln in lines)
    ups = [shlex.split(ln) for ln in lines if ln.endswith("up -d --force-recreate vllm")]
    ov = {g: str(work / f"override-{g}_0.yaml") for g in ("VLLM_PLE_PREFETCH", "VLLM_PP_DEFERRED_RECV")}
    assert ups == [
        ["docker", "compose", "-f", "compose.yaml", "up", "-d", "--force-recreate", "vllm"],
        ["docker", "compose", "-f", "compose.yaml", "-f", ov["VLLM_PLE_PREFETCH"], "up", "-d", "--force-recreate", "vllm"],
        ["docker", "compose", "-f", "compose.yaml", "-f", ov["VLLM_PP_DEFERRED_RECV"], "up", "-d", "--force-recreate", "vllm"],
        ["docker", "compose", "-f", "compose.yaml", "up", "-d", "--force-recreate", "vllm"],  # restore
    ]
    # the override of a variant sets exactly its gate to "0"
    i = lines.index(f"cat > {ov['VLLM_PLE_PREFETCH']} <<'EOF'")
    body = lines[i + 1:lines.index("EOF", i)]
    assert body[1:] == ["services:", "  vllm:", "    environment:", '      VLLM_PLE_PREFETCH: "0"']
    benches = [shlex.split(ln) for ln in lines if "bench_serving.py" in ln]
    assert len(benches) == 3
    for b, variant in zip(benches, ["baseline", "VLLM_PLE_PREFETCH=0", "VLLM_PP_DEFERRED_RECV=0"]):
        slug = variant.replace("=", "_")
        assert b[b.index("--label") + 1] == variant and b[b.index("--cold-salt") + 1] == slug
        assert b[b.index("--json") + 1] == str(work / f"{slug}.json")
        assert b[-4:] == ["--concurrency", "1,4", "--prompt-tokens", "0,8k"]
        assert b[b.index("--base-url") + 1] == "http://127.0.0.1:8000/v1"
    logs = [ln for ln in lines if " logs --no-color vllm" in ln]
    assert len(logs) == 3 and all("grep 'vllm-3x3090 patches'" in ln for ln in logs)


def test_plan_options(tmp_path, manifest, capsys):
    work = str(tmp_path / "w")
    assert ab.main(["--manifest", str(manifest), "--dry-run", "--work-dir", work, "--no-restore",
                    "--off-value", "VLLM_PLE_MMAP_PATH=", "--skip", "VLLM_PP_DEFERRED_RECV",
                    "--compose-cmd", "podman-compose", "-f", "compose.yaml", "-f", "compose/mtp.yaml"]) == 0
    out = capsys.readouterr().out
    heads = [ln for ln in out.splitlines() if ln.startswith("## [")]
    assert heads == ["## [1/3] baseline", "## [2/3] VLLM_PLE_MMAP_PATH=", "## [3/3] VLLM_PLE_PREFETCH=0"]
    assert '      VLLM_PLE_MMAP_PATH: ""' in out.splitlines()
    assert "## restore" not in out
    assert "podman-compose -f compose.yaml -f compose/mtp.yaml -f " in out
    assert ab.main(["--manifest", str(manifest), "--dry-run", "--only", "VLLM_NOPE"]) == 2
    assert "not a gate of this series" in capsys.readouterr().err


def test_gates_from_repo_series_and_patch_headers(tmp_path, capsys):
    repo_patches = HERE.parents[1] / "patches"
    assert ab.main(["--patches", str(repo_patches), "--dry-run", "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    import vllm_patches as vp

    series = vp.load_series(repo_patches)
    flips = [p.gate for p in series if p.gate not in ab.NOT_AB and not vp.is_opt_in(p)
             and not ab.needs_mtp(p.gate)]
    n = len(flips) + 1
    assert "# skipped VLLM_PATCH_GATES_LOG" in out and f"## [1/{n}] baseline" in out
    for i, g in enumerate(flips, start=2):
        assert f"## [{i}/{n}] {g}=0" in out
    assert ab.main(["--patches", str(repo_patches), "--dry-run", "--work-dir", str(tmp_path),
                    "--only", "VLLM_PATCH_GATES_LOG"]) == 0
    assert "## [2/2] VLLM_PATCH_GATES_LOG=0" in capsys.readouterr().out
    # a manifest without gate_field: the opt-in mark is read from the patch header
    pd = tmp_path / "p"
    pd.mkdir()
    (pd / "0100-x.patch").write_text("Description: x\nGate: VLLM_X_PATH (opt-in: unset = upstream)\n---\n"
                                     "diff --git a/f b/f\n")
    gates = ab.gates_of({"series": [{"name": "0100-x.patch", "gate": "VLLM_X_PATH"},
                                    {"name": "0200-y.patch", "gate": "VLLM_Y"}]}, pd)
    assert [(g["gate"], g["opt_in"]) for g in gates] == [("VLLM_X_PATH", True), ("VLLM_Y", False)]


def test_parse_gates_line():
    line = "INFO [core.py:129] vllm-3x3090 patches (2): 0010-patch-gates[VLLM_PATCH_GATES_LOG]=on 0200-x[VLLM_X]=off"
    assert ab.parse_gates_line(line) == {"VLLM_PATCH_GATES_LOG": True, "VLLM_X": False}


def fake_env(monkeypatch, tmp_path, **extra):
    env = {"FAKE_COMPOSE_LOG": str(tmp_path / "compose.log"), "FAKE_COMPOSE_GATES": ",".join(GATES),
           "FAKE_COMPOSE_ITL_FILE": str(tmp_path / "itl"),
           "FAKE_COMPOSE_ITL": json.dumps({"VLLM_PP_DEFERRED_RECV": 0.016}), "FAKE_COMPOSE_ITL_BASE": "0.004",
           "FAKE_COMPOSE_TTFT_FILE": str(tmp_path / "ttft"),
           "FAKE_COMPOSE_TTFT": json.dumps({"VLLM_PLE_PREFETCH": 0.3}), "FAKE_COMPOSE_TTFT_BASE": "0.1",
           "FAKE_COMPOSE_MANIFEST": str(tmp_path / "manifest.json")}
    env.update(extra)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VLLM_API_KEY", "test-key")
    (tmp_path / "manifest.json").write_text(json.dumps(MANIFEST))


def compose_calls(tmp_path):
    p = tmp_path / "compose.log"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def ab_args(srv, work, *more):
    return ["--base-url", srv.base_url, "--work-dir", str(work), "--settle-s", "0", "--health-timeout", "10",
            "--compose-cmd", f"{shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'fake_compose.py'))}",
            *more, "--", "--concurrency", "1", "--prompt-tokens", "0", "--max-tokens", "20", "--warmup", "0",
            "--runs", "2", "--no-tokenize", "--timeout", "20"]


def test_full_run_goes_past_a_failed_variant_resumes_and_scores_each_gate_on_its_metric(
        tmp_path, monkeypatch, capsys):
    fake_env(monkeypatch, tmp_path, FAKE_COMPOSE_FAIL_UP="VLLM_PLE_PREFETCH")
    work = tmp_path / "work"
    cfg = FakeConfig(ttft=0.1, itl=0.004, itl_file=str(tmp_path / "itl"), ttft_file=str(tmp_path / "ttft"))
    with FakeServer(cfg) as srv:
        # 1st run: the 2nd variant's container fails to start -> recorded, the 3rd still runs
        assert ab.main(ab_args(srv, work)) == 1
        err = capsys.readouterr().err
        assert "VLLM_PLE_PREFETCH=0: compose up failed" in err and "going on with the next variant" in err
        assert "1 variant(s) failed: VLLM_PLE_PREFETCH=0" in err
        state = json.loads((work / "state.json").read_text())
        assert list(state["variants"]) == ["baseline", "VLLM_PLE_PREFETCH=0", "VLLM_PP_DEFERRED_RECV=0"]
        assert "compose up failed" in state["variants"]["VLLM_PLE_PREFETCH=0"]["failed"]
        assert "[VLLM_PP_DEFERRED_RECV]=off" in state["variants"]["VLLM_PP_DEFERRED_RECV=0"]["gates_line"]
        assert "VLLM_PLE_PREFETCH=0" in (work / "ab-report.md").read_text().split("failed variants")[1]
        calls1 = compose_calls(tmp_path)
        assert calls1[-1][-4:] == ["up", "-d", "--force-recreate", "vllm"]
        assert not any("override" in a for a in calls1[-1])  # restored without an override
        n_chat1 = sum(p == "/v1/chat/completions" for p, _ in srv.state.requests)
        assert n_chat1 == 2 * 2  # 2 variants x 2 runs
        # 2nd run: resumes; only the failed variant is benchmarked
        monkeypatch.delenv("FAKE_COMPOSE_FAIL_UP")
        assert ab.main(ab_args(srv, work)) == 0
        out = capsys.readouterr().out
        n_chat2 = sum(p == "/v1/chat/completions" for p, _ in srv.state.requests)
    assert "== baseline: done earlier" in out and "== VLLM_PP_DEFERRED_RECV=0: done earlier" in out
    assert n_chat2 - n_chat1 == 2
    calls2 = compose_calls(tmp_path)[len(calls1):]
    ups = [c for c in calls2 if "up" in c]
    assert len(ups) == 2 and any("override-VLLM_PLE_PREFETCH_0.yaml" in a for a in ups[0])
    report = json.loads((work / "ab-report.json").read_text())
    c = report["contributions"]
    assert report["metrics"] == {"VLLM_PLE_PREFETCH=0": "ttft", "VLLM_PP_DEFERRED_RECV=0": "decode"}
    assert report["failed"] == {}
    # prefetch: TTFT 0.1 s with the patch, 0.3 s without -> +200 % on TTFT (its decode is unchanged)
    # (wide bounds: sleeps overshoot on a loaded machine)
    assert 80 < c["VLLM_PLE_PREFETCH=0"]["0/warm/x1"] < 400, c
    # deferred recv: ITL 4 ms with the patch, 16 ms without -> +300 % on decode tok/s
    assert 80 < c["VLLM_PP_DEFERRED_RECV=0"]["0/warm/x1"] < 600, c
    md = (work / "ab-report.md").read_text()
    assert "| VLLM_PLE_PREFETCH=0 | TTFT | 0/warm/x1 |" in md
    assert "| VLLM_PP_DEFERRED_RECV=0 | decode tok/s | 0/warm/x1 |" in md
    assert (work / "ab-contrib.png").read_bytes()[:4] == b"\x89PNG"
    # the API key reached bench_serving through the environment, never argv
    bench = json.loads((work / "VLLM_PLE_PREFETCH_0.json").read_text())
    assert bench["label"] == "VLLM_PLE_PREFETCH=0" and "test-key" not in " ".join(bench["command"])


def test_gate_that_stays_on_is_refused(tmp_path, monkeypatch, capsys):
    fake_env(monkeypatch, tmp_path, FAKE_COMPOSE_STUCK="VLLM_PLE_PREFETCH")
    with FakeServer(FakeConfig(ttft=0.0, itl=0.001)) as srv:
        # no --manifest: read from the "container" through `compose exec`
        assert ab.main(ab_args(srv, tmp_path / "w", "--no-restore")) == 1
    err = capsys.readouterr().err
    assert "reports VLLM_PLE_PREFETCH on after setting it to '0'" in err
    assert any(c[c.index("exec"):c.index("exec") + 4] == ["exec", "-T", "vllm", "python3"]
               for c in compose_calls(tmp_path) if "exec" in c)


def test_dry_run_asks_no_container_and_skips_what_cannot_apply(tmp_path, capsys):
    # a compose command that would fail if called: the dry run must not call it
    base = ["--dry-run", "--work-dir", str(tmp_path), "--compose-cmd", "false"]
    assert ab.main(base) == 0
    out = capsys.readouterr().out
    assert "this repository's series" in out
    import vllm_patches as vp

    gates = {p.gate for p in vp.load_series()}
    for g in sorted(ab.NEEDS_MTP & gates):
        assert f"# skipped {g}: acts only with MTP" in out and f"] {g}=0" not in out
    if "VLLM_PINNED_POOL" in gates:
        assert "# skipped VLLM_PINNED_POOL: =0 restores power-of-two" in out
    if "VLLM_PLE_PREFETCH" in gates:
        assert "scored on TTFT" in out and "--prefix both" in out
    # with the MTP compose files, the MTP gates are planned
    assert ab.main(base + ["-f", "compose.yaml", "-f", "compose/mtp.yaml", "--", "--prefix", "both"]) == 0
    out = capsys.readouterr().out
    for g in sorted(ab.NEEDS_MTP & gates):
        assert f"] {g}=0" in out
    assert "scored on TTFT" not in out
    if ab.NEEDS_MTP & gates:
        g = sorted(ab.NEEDS_MTP & gates)[0]
        assert ab.main(base + ["--only", g]) == 2
        assert "compose/mtp.yaml" in capsys.readouterr().err


def test_a_variant_whose_engine_dies_is_not_waited_for(tmp_path, monkeypatch, capsys):
    import time

    fake_env(monkeypatch, tmp_path, FAKE_COMPOSE_FATAL="VLLM_PLE_PREFETCH",
             FAKE_COMPOSE_UNHEALTHY_FILE=str(tmp_path / "unhealthy"))
    work = tmp_path / "work"
    cfg = FakeConfig(ttft=0.01, itl=0.001, unhealthy_file=str(tmp_path / "unhealthy"))
    with FakeServer(cfg) as srv:
        args = ab_args(srv, work, "--manifest", str(tmp_path / "manifest.json"), "--log-check-s", "0.2")
        args[args.index("--health-timeout") + 1] = "60"
        t0 = time.monotonic()
        assert ab.main(args) == 1
        took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert "VLLM_PLE_PREFETCH=0: the server failed to start" in err and "Engine core initialization failed" in err
    assert took < 30  # not the 60 s health timeout
    state = json.loads((work / "state.json").read_text())
    assert "failed to start" in state["variants"]["VLLM_PLE_PREFETCH=0"]["failed"]
    assert "json" in state["variants"]["VLLM_PP_DEFERRED_RECV=0"]  # the next variant ran

"""compose.yaml and its variants carry SPEC §10 exactly, stay safe by
default, and every VLLM_* variable they (or the docs) name exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

import vllm_patches as vp

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO.parent / "shared" / "spec" / "SPEC.md"

# SPEC "Production flags (§10)", verbatim.
SPEC_FLAGS = """\
--pipeline-parallel-size 3 --tensor-parallel-size 1
--max-model-len 262144 --max-num-seqs 4 --max-num-batched-tokens 512
--enable-prefix-caching --mamba-cache-mode align
--gpu-memory-utilization 0.97 --kv-cache-memory-bytes 783000000
--limit-mm-per-prompt '{"image":4,"video":0}' --mm-processor-kwargs '{"max_pixels":2097152}'
--compilation-config '{"mode":0,"cudagraph_mode":"FULL_DECODE_ONLY","cudagraph_capture_sizes":[1,2,4]}'
VLLM_PLE_MMAP_PATH=<table file>  VLLM_QSA_KV_OFFLOAD=1
VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cap_add: SYS_PTRACE   ulimits: memlock -1
"""
# What compose adds beyond §10: serving identity and qwen-code's parsers.
EXTRA_FLAGS = {"--served-model-name": "qwen3.8-flash-next", "--host": "0.0.0.0", "--port": "8000",
               "--enable-auto-tool-choice": None, "--tool-call-parser": "qwen3_coder",
               "--reasoning-parser": "qwen3", "--enable-prompt-tokens-details": None}


def parse_spec():
    import shlex

    flags: dict[str, object] = {}
    env: dict[str, str] = {}
    toks = shlex.split(SPEC_FLAGS.split("VLLM_PLE_MMAP_PATH")[0])
    i = 0
    while i < len(toks):
        t = toks[i]
        if i + 1 < len(toks) and not toks[i + 1].startswith("--"):
            flags[t] = toks[i + 1]
            i += 2
        else:
            flags[t] = None
            i += 1
    for m in re.finditer(r"([A-Z_]+)=(\S+)", SPEC_FLAGS):
        env[m.group(1)] = m.group(2)
    return flags, env


def norm(v):
    if isinstance(v, str) and v[:1] in "{[":
        return json.loads(v)
    return v


def command_flags(cmd: list[str]) -> tuple[str, dict]:
    model, rest = cmd[0], cmd[1:]
    flags: dict[str, object] = {}
    i = 0
    while i < len(rest):
        t = rest[i]
        assert t.startswith("--"), f"stray argument {t!r}"
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            assert t not in flags, f"{t} given twice"
            flags[t] = rest[i + 1]
            i += 2
        else:
            flags[t] = None
            i += 1
    return model, flags


def load(name):
    return yaml.safe_load((REPO / name).read_text())


def test_spec_block_is_the_spec():
    if not SPEC.exists():
        pytest.skip("shared/spec not beside the checkout")
    text = SPEC.read_text()
    block = text.split("## Production flags (§10)\n```\n", 1)[1].split("```", 1)[0]
    assert block == SPEC_FLAGS


def test_compose_production_flags_exact():
    svc = load("compose.yaml")["services"]["vllm"]
    spec_flags, spec_env = parse_spec()
    model, flags = command_flags(svc["command"])
    assert model == "/models/qwen3.8-flash-next"
    want = {**{k: norm(v) for k, v in spec_flags.items()}, **EXTRA_FLAGS}
    assert {k: norm(v) for k, v in flags.items()} == want
    env = svc["environment"]
    # A §10 variable whose patch is not in the series (as VLLM_QSA_KV_OFFLOAD
    # was before 0220 landed) must be absent: vLLM would only warn about an unknown
    # variable and run without the feature. Once the patch is in, it must be set.
    known = _upstream_env_names() | _series_gates()
    want_env = {k: v for k, v in spec_env.items() if not k.startswith("VLLM_") or k in known}
    for k, v in want_env.items():
        if k == "VLLM_PLE_MMAP_PATH":
            assert env[k] == "/ple/ple_table.bin"
        else:
            assert str(env[k]) == v, k
    # Beyond the write-up's set: only opt-in gates of the series passed
    # through from .env with their off value (0260's VLLM_QSA_KV_FP8), which
    # serve exactly what the set alone serves until the user turns one on.
    extra = set(env) - set(want_env) - {"VLLM_API_KEY"}
    for k in extra:
        assert k in _series_gates() and str(env[k]) == "${%s:-0}" % k, (k, env[k])
    assert set(want_env) | {"VLLM_API_KEY"} <= set(env)
    assert {"VLLM_PLE_MMAP_PATH", "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"} <= set(want_env)
    assert "SYS_PTRACE" in svc["cap_add"] and "SYS_NICE" in svc["cap_add"]
    assert svc["ulimits"]["memlock"] == -1
    assert svc["ipc"] == "host"
    dev = svc["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["count"] == 3 and "gpu" in dev["capabilities"]


def test_compose_mounts_ple_and_model_read_only():
    svc = load("compose.yaml")["services"]["vllm"]
    vols = svc["volumes"]
    assert any(v.endswith(":/models/qwen3.8-flash-next:ro") and "${MODEL_DIR" in v for v in vols)
    assert any(v.endswith(":/ple/ple_table.bin:ro") and "${PLE_TABLE" in v for v in vols)
    env_example = (REPO / ".env.example").read_text()
    for var in ("MODEL_DIR", "PLE_TABLE", "VLLM_API_KEY", "HOST_BIND", "PORT", "MTP_INT4_DIR"):
        assert re.search(rf"^{var}=", env_example, re.M), var


def test_compose_safe_by_default():
    svc = load("compose.yaml")["services"]["vllm"]
    assert svc["ports"] == ["${HOST_BIND:-127.0.0.1}:${PORT:-8000}:8000"]
    assert svc["environment"]["VLLM_API_KEY"].startswith("${VLLM_API_KEY:?")
    assert svc["restart"] in ("unless-stopped", "always")


def test_healthcheck_is_a_real_completion():
    hc = load("compose.yaml")["services"]["vllm"]["healthcheck"]
    import shlex

    # CMD-SHELL: podman-compose 1.0.3 turns a CMD list into a shell syntax error.
    assert hc["test"][0] == "CMD-SHELL" and len(hc["test"]) == 2
    argv = shlex.split(hc["test"][1])
    assert argv[:2] == ["python3", "-c"] and len(argv) == 3
    script = argv[2]
    assert "/v1/completions" in script and '"max_tokens": 1' in script
    assert "Authorization" in script
    compile(script, "healthcheck", "exec")
    start = int(hc["start_period"].rstrip("s"))
    assert start >= 600


def test_mtp_variant():
    base = load("compose.yaml")["services"]["vllm"]
    svc = load("compose/mtp.yaml")["services"]["vllm"]
    _, base_flags = command_flags(base["command"])
    model, flags = command_flags(svc["command"])
    # make_mtp_int4.py's output directory, mounted on its own (a file mount
    # inside the read-only checkpoint mount cannot be created), is the model.
    assert model == "/models/mtp-overlay"
    assert svc["volumes"] == ["${MTP_INT4_DIR:?set MTP_INT4_DIR in .env}:/models/mtp-overlay:ro"]
    assert flags["--kv-cache-memory-bytes"] == "550000000"
    assert flags["--max-num-seqs"] == "2"
    assert norm(flags["--speculative-config"]) == {"method": "mtp", "num_speculative_tokens": 1}
    changed = {k for k in set(flags) | set(base_flags) if flags.get(k) != base_flags.get(k)}
    assert changed == {"--kv-cache-memory-bytes", "--max-num-seqs", "--speculative-config"}
    assert svc["environment"]["VLLM_PP_LAYER_PARTITION"] == "16,17,15"
    assert sum(map(int, "16,17,15".split(","))) == 48
    assert all(v.endswith(":ro") for v in svc["volumes"])


def test_podman_variant_uses_cdi():
    svc = load("compose/podman.yaml")["services"]["vllm"]
    assert "nvidia.com/gpu=all" in svc["devices"]


def _upstream_env_names() -> set[str]:
    pristine = vp.pristine_cache(log=lambda *a: None)
    text = (pristine / "vllm" / "envs.py").read_text()
    return set(vp.ENVS_ENTRY_RE.findall(text))


def _series_gates() -> set[str]:
    return set(vp.envs_gates(vp.load_series()))


# Our own variables (build args, tool settings): not vLLM's.
OWN = re.compile(r"VLLM_IMAGE$|VLLM_3X3090_")


def test_every_vllm_variable_named_is_declared():
    files = [REPO / "compose.yaml", REPO / "Dockerfile", REPO / "README.md", REPO / ".env.example",
             *sorted((REPO / "compose").glob("*.yaml")), *sorted((REPO / "docker").iterdir())]
    known = _upstream_env_names() | _series_gates()
    unknown = {}
    for f in files:
        for name in set(re.findall(r"\bVLLM_[A-Z0-9_]*[A-Z0-9]\b", f.read_text())):
            if not OWN.match(name) and name not in known:
                unknown.setdefault(name, []).append(f.name)
    assert not unknown, f"VLLM_* named but declared neither upstream nor by a patch: {unknown}"


def test_ab_variant_in_sync_with_series():
    text = (REPO / "compose" / "ab.yaml").read_text()
    assert text == vp.compose_ab(), "stale: run `python3 scripts/vllm_patches.py gates --compose-ab compose/ab.yaml`"
    env = yaml.safe_load(text)["services"]["vllm"]["environment"]
    want = {p.gate for p in vp.load_series() if not vp.is_opt_in(p)}
    assert set(env) == want

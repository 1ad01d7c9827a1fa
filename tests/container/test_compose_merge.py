"""podman_env's compose merge and interpolation (no container runtime): the
rules docker compose applies, on this repo's files, since the container test
derives its `podman run` arguments from them."""

import pytest
import yaml

import podman_env as pe

ENV = {"MODEL_DIR": "/m", "PLE_TABLE": "/p.bin", "VLLM_API_KEY": "k", "MTP_INT4_DIR": "/o"}


def raw(name):
    return yaml.safe_load((pe.REPO / name).read_text())["services"]["vllm"]


def test_mtp_merge_replaces_command_and_adds_up_the_rest():
    svc = pe.merged_service([pe.REPO / "compose.yaml", pe.REPO / "compose" / "mtp.yaml"], ENV)
    assert svc["command"] == raw("compose/mtp.yaml")["command"]  # podman-compose 1.0.3 appends
    assert svc["environment"]["VLLM_PP_LAYER_PARTITION"] == "16,17,15"
    assert svc["environment"]["VLLM_PLE_MMAP_PATH"] == "/ple/ple_table.bin"
    assert svc["volumes"] == ["/m:/models/qwen3.8-flash-next:ro", "/p.bin:/ple/ple_table.bin:ro",
                              "/o:/models/mtp-overlay:ro"]
    assert svc["image"] == "vllm-3x3090:0.30.0" and svc["ports"] == ["127.0.0.1:8000:8000"]


def test_later_volume_on_the_same_target_replaces():
    svc = pe._merge_service({"volumes": ["${A:?x}:/t:ro", "/b:/u"]}, {"volumes": ["/c:/t:ro"]})
    assert svc["volumes"] == ["/c:/t:ro", "/b:/u"]


def test_interpolation():
    assert pe.interpolate("${A:-d} ${B-e} $$x $C", {"A": "", "B": "", "C": "c"}) == "d  $x c"
    with pytest.raises(ValueError, match="set MODEL_DIR in .env"):
        pe.merged_service([pe.REPO / "compose.yaml"], {k: v for k, v in ENV.items() if k != "MODEL_DIR"})


def test_run_args_maps_every_key_and_says_what_it_leaves_out():
    svc = pe.merged_service([pe.REPO / "compose.yaml", pe.REPO / "compose" / "podman.yaml"], ENV)
    args, left = pe.run_args(svc, "n", image="img", memlock_ok=True)
    i = args.index("img")
    assert args[i + 1:] == svc["command"]
    assert ["--ipc", "host"] == args[args.index("--ipc"):args.index("--ipc") + 2]
    assert "label=disable" in args and "nvidia.com/gpu=all" not in args
    assert any(s.startswith("device nvidia.com/gpu=all") for s in left)
    assert "memlock=-1:-1" in args
    assert "memlock=-1:-1" not in pe.run_args(svc, "n", image="img", memlock_ok=False)[0]
    with pytest.raises(ValueError, match="privileged"):
        pe.run_args({**svc, "privileged": True}, "n", memlock_ok=True)

"""scripts/serve-tools/make_mtp_int4.py on a small synthetic safetensors checkpoint."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import make_mtp_int4 as tool

H, I = 256, 128  # hidden, expert intermediate (multiples of 128)
MTP = [
    f"mtp.layers.0.mlp.experts.{e}.{p}.weight"
    for e in range(2)
    for p in ("gate_proj", "up_proj", "down_proj")
]
SHARED = "mtp.layers.0.mlp.shared_expert.gate_proj.weight"
OTHER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "chat_template.jinja", "preprocessor_config.json"]


def _weight(name, g):
    shape = (H, I) if "down_proj" in name else (I, H)
    w = torch.randn(shape, generator=g) * 0.02
    # A few outliers: where absmax RTN wastes range and clip search pays off.
    w.view(-1)[torch.randint(0, w.numel(), (8,), generator=g)] *= 12
    return w.to(torch.bfloat16)


def _make_ckpt(d, ignore):
    g = torch.Generator().manual_seed(0)
    d.mkdir()
    a = {n: _weight(n, g) for n in MTP}
    a[SHARED] = _weight("x", g)
    b = {"model.embed_tokens.weight": torch.randn(64, H).to(torch.bfloat16)}
    save_file(a, str(d / "model-00001-of-00002.safetensors"))
    save_file(b, str(d / "model-00002-of-00002.safetensors"))
    wm = {n: "model-00001-of-00002.safetensors" for n in a}
    wm.update({n: "model-00002-of-00002.safetensors" for n in b})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    for f in OTHER_FILES:
        (d / f).write_text("{}")
    cfg = {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                "strategy": "group", "group_size": 32},
                },
                # An existing regex target over the experts: must not win.
                "group_1": {
                    "targets": [r"re:.*mlp\.experts.*"],
                    "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                "strategy": "channel"},
                },
            },
            "ignore": ignore,
        },
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d, {**a, **b}


@pytest.fixture
def ckpt(tmp_path):
    return _make_ckpt(tmp_path / "ckpt", ["lm_head", "mtp.layers.0.mlp.experts.0.gate_proj"])


@pytest.fixture
def ckpt_re(tmp_path):
    """The ignore list as regexes (re:), one covering the whole MTP head."""
    return _make_ckpt(tmp_path / "ckpt_re", ["lm_head", "re:.*mtp.*", r"re:^model\.visual\..*"])


def _digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _group_sse(q, s, w):
    return ((tool.dequantize(q, s) - w) ** 2).reshape(w.shape[0], -1, 128).sum(-1)


def test_clip_search_never_worse_than_absmax_as_stored():
    """Per group, with the scales as stored (bf16): the searched clip is never
    worse than absmax. 10,240 groups per seed (the old fp32-scale q lost 1-54
    of them once its scales were rounded to bf16)."""
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(640, 2048, generator=g) * 0.02)
        w.view(-1)[torch.randint(0, w.numel(), (4000,), generator=g)] *= 12
        w = w.to(torch.bfloat16).float()
        qa, sa = tool.quantize_rtn(w, search=False)
        qs, ss = tool.quantize_rtn(w, search=True)
        for s in (sa, ss):  # what is stored is exactly this
            assert torch.equal(s.to(torch.bfloat16).float(), s)
        ea, es = _group_sse(qa, sa.to(torch.bfloat16), w), _group_sse(qs, ss.to(torch.bfloat16), w)
        assert ea.numel() == 10_240
        assert int((es > ea).sum()) == 0
        assert float(es.sum()) < 0.9 * float(ea.sum())


def test_dequant_error_bounds():
    g = torch.Generator().manual_seed(2)
    w = _weight("up_proj", g).float()
    q, s = tool.quantize_rtn(w)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    err = (tool.dequantize(q, s) - w).abs().reshape(w.shape[0], -1, 128)
    wg = w.reshape(w.shape[0], -1, 128)
    inside = wg.abs() <= 7 * s[..., None]
    # Inside the clip range the error is at most half a step.
    assert bool((err[inside] <= s[..., None].expand_as(err)[inside] / 2 + 1e-7).all())
    rel = float((err**2).sum() / (wg**2).sum())
    assert rel < 0.02, rel


def test_pack_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    q = torch.randint(-8, 8, (16, 256), dtype=torch.int8)
    assert torch.equal(tool.pack_int4(q), pack_to_int32(q, 4))
    assert torch.equal(unpack_from_int32(tool.pack_int4(q), 4, q.shape), q)


def test_dry_run_writes_nothing(ckpt, tmp_path, capsys):
    d, _ = ckpt
    out = tmp_path / "out"
    assert tool.main([str(d), str(out), "--dry-run", "--json"]) == 0
    assert not out.exists()
    text = capsys.readouterr().out
    assert "would quantize 6 tensors" in text
    for f in ("config.json", "model.safetensors.index.json", "mtp-int4.safetensors"):
        assert str(out / f) in text
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["symlinks"] == 2 + len(OTHER_FILES) and summary["dry_run"]


def _scheme(qc, module):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
        CompressedTensorsConfig,
    )

    ct = CompressedTensorsConfig.from_config(qc)
    d = ct.get_scheme_dict(torch.nn.Linear(1, 1), module)
    return None if d is None else (d["weights"].num_bits, d["weights"].group_size)


@pytest.mark.parametrize("which", ["plain", "regex"])
def test_overlay_directory(request, tmp_path, which, capsys):
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationScheme

    d, orig = request.getfixturevalue("ckpt" if which == "plain" else "ckpt_re")
    before = _digest(d)
    out = tmp_path / "out"
    assert tool.main([str(d), str(out)]) == 0
    assert _digest(d) == before  # checkpoint untouched
    assert "dangle" in capsys.readouterr().out  # default mount: not this host's path
    # A complete model directory: three real files, the rest symlinks into
    # the checkpoint's mount point (default: compose's).
    entries = {p.name: p for p in out.iterdir()}
    assert sorted(entries) == sorted(
        ["config.json", "model.safetensors.index.json", "mtp-int4.safetensors",
         "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", *OTHER_FILES])
    for name, p in entries.items():
        if name in tool.OWN_FILES:
            assert p.is_file() and not p.is_symlink()
        else:
            assert p.is_symlink()
            assert os.readlink(p) == f"/models/qwen3.8-flash-next/{name}"

    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert list(qc["config_groups"])[0] == tool.GROUP_NAME  # first: wins over group_1
    assert {"group_0", "group_1"} <= set(qc["config_groups"])  # existing groups kept
    assert "lm_head" in qc["ignore"]
    assert "mtp.layers.0.mlp.experts.0.gate_proj" not in qc["ignore"]
    # vLLM maps every expert to the new group (the ignore list no longer
    # cancels it), and what the old ignore entries covered stays ignored.
    for n in MTP:
        assert _scheme(qc, n[: -len(".weight")]) == (4, 128), n
    assert _scheme(qc, "lm_head") is None
    if which == "regex":
        assert _scheme(qc, SHARED[: -len(".weight")]) is None  # still under re:.*mtp.*
        assert _scheme(qc, "mtp.layers.0.self_attn.o_proj") is None
        assert _scheme(qc, "model.visual.blocks.0.attn.qkv") is None
        # The old config: the regex ignore cancelled the group.
        old = json.loads((d / "config.json").read_text())["quantization_config"]
        old["config_groups"] = {tool.GROUP_NAME: qc["config_groups"][tool.GROUP_NAME],
                                **old["config_groups"]}
        assert _scheme(old, MTP[0][: -len(".weight")]) is None

    wm = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    # Unquantized tensors still point at the original shards (relative names).
    assert wm["model.embed_tokens.weight"] == "model-00002-of-00002.safetensors"
    assert wm[SHARED] == "model-00001-of-00002.safetensors"
    scheme = QuantizationScheme.model_validate(qc["config_groups"][tool.GROUP_NAME])
    with safe_open(str(out / "mtp-int4.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        # The bf16 names are assigned to mtp-int4.safetensors, which does not
        # hold them: the loader (0120) then skips their copies in the shards.
        assert keys == {k for k, v in wm.items() if v == "mtp-int4.safetensors"} - set(MTP)
        for n in MTP:
            assert wm[n] == "mtp-int4.safetensors" and n not in keys
            base = n[: -len(".weight")]
            sd = {s: f.get_tensor(f"{base}.{s}") for s in
                  ("weight_packed", "weight_scale", "weight_shape")}
            assert sd["weight_packed"].dtype == torch.int32
            assert sd["weight_scale"].dtype == torch.bfloat16
            w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"].float()
            ref = orig[n].float()
            assert w.shape == ref.shape
            rel = float(((w - ref) ** 2).sum() / (ref**2).sum())
            assert rel < 0.02, (n, rel)


def test_rerun_and_mount(ckpt, tmp_path, capsys):
    d, _ = ckpt
    out = tmp_path / "out"
    assert tool.main([str(d), str(out), "--checkpoint-mount", str(d)]) == 0
    assert "dangle" not in capsys.readouterr().out
    # Symlinks resolve when the mount is the checkpoint's own path.
    assert (out / "tokenizer.json").read_text() == "{}"
    first = _digest(out)
    assert tool.main([str(d), str(out), "--checkpoint-mount", str(d)]) == 0  # again: same
    assert _digest(out) == first
    (out / "stray.txt").write_text("x")
    with pytest.raises(SystemExit, match="did not write"):
        tool.main([str(d), str(out)])


def test_errors_say_what_to_do(ckpt, tmp_path):
    d, _ = ckpt
    with pytest.raises(SystemExit, match="--pattern"):
        tool.main([str(d), str(tmp_path / "o"), "--pattern", "^nothing$"])
    with pytest.raises(SystemExit, match="differ"):
        tool.main([str(d), str(d)])


def test_bare_python(ckpt, tmp_path):
    """--help and --dry-run on a python3 without torch (-S: no site-packages);
    a real run says where it runs instead of a traceback."""
    d, _ = ckpt
    script = tool.__file__
    r = subprocess.run([sys.executable, "-S", script, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--checkpoint-mount" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-S", script, str(d), str(tmp_path / "o"), "--dry-run"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "would quantize 6" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-S", script, str(d), str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "docker compose run" in r.stderr and ".venv/bin/python" in r.stderr
    assert not (tmp_path / "o").exists()


def test_readme_steps(ckpt, tmp_path):
    """README's MTP commands: the compose-run invocation names the image's
    script, compose's checkpoint mount and the -v target, the variables come
    from .env.example; run as written (paths mapped to this host), it makes
    the overlay. The venv form is what the other tests here run."""
    import re
    import shlex

    import yaml

    repo = tool.Path(tool.__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text()
    block = readme[readme.index("compose/mtp.yaml up -d`: MTP"):]
    block = block[block.index("```") + 3:]
    block = block[: block.index("```")].replace("\\\n", " ")
    run = next(ln for ln in block.splitlines() if "make_mtp_int4.py" in ln)
    argv = shlex.split(run)
    assert argv[:3] == ["docker", "compose", "run"]
    vol = argv[argv.index("-v") + 1]
    assert vol.split(":")[0] == "$MTP_INT4_DIR"
    script = next(i for i, a in enumerate(argv) if a.endswith("make_mtp_int4.py"))
    assert argv[script] == "/opt/vllm-3x3090/scripts/serve-tools/make_mtp_int4.py"
    assert "COPY scripts/serve-tools/ /opt/vllm-3x3090/scripts/serve-tools/" in (repo / "Dockerfile").read_text()
    args = argv[script + 1:]
    compose = yaml.safe_load((repo / "compose.yaml").read_text())
    mounts = {}
    for v in compose["services"]["vllm"]["volumes"]:  # SRC:TARGET[:ro], SRC may hold ":?"
        src, target = re.fullmatch(r"(.*):(/[^:]*)(:ro)?", v).group(1, 2)
        mounts[target] = src
    assert mounts[args[0]].startswith("${MODEL_DIR")
    assert args[0] == tool.DEFAULT_MOUNT  # the symlinks point where compose mounts it
    assert args[1] == vol.split(":")[1]
    env = (repo / ".env.example").read_text()
    for var in set(re.findall(r"\$\{?([A-Z0-9_]+)", block)):
        assert re.search(rf"^{var}=", env, re.M), var
    d, _ = ckpt
    out = tmp_path / "out"
    host = [str(d) if a == args[0] else str(out) if a == args[1] else a for a in args]
    assert "--dry-run" in host
    assert tool.main(host) == 0 and not out.exists()
    assert tool.main([a for a in host if a != "--dry-run"]) == 0
    assert os.readlink(out / "tokenizer.json") == f"{tool.DEFAULT_MOUNT}/tokenizer.json"

"""scripts/make_mtp_int4.py on a small synthetic safetensors checkpoint."""

import hashlib
import json

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


def _weight(name, g):
    shape = (H, I) if "down_proj" in name else (I, H)
    w = torch.randn(shape, generator=g) * 0.02
    # A few outliers: where absmax RTN wastes range and clip search pays off.
    w.view(-1)[torch.randint(0, w.numel(), (8,), generator=g)] *= 12
    return w.to(torch.bfloat16)


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    d = tmp_path / "ckpt"
    d.mkdir()
    a = {n: _weight(n, g) for n in MTP}
    a["mtp.layers.0.mlp.shared_expert.gate_proj.weight"] = _weight("x", g)
    b = {"model.embed_tokens.weight": torch.randn(64, H).to(torch.bfloat16)}
    save_file(a, str(d / "model-00001-of-00002.safetensors"))
    save_file(b, str(d / "model-00002-of-00002.safetensors"))
    wm = {n: "model-00001-of-00002.safetensors" for n in a}
    wm.update({n: "model-00002-of-00002.safetensors" for n in b})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    cfg = {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                "strategy": "group", "group_size": 128},
                }
            },
            "ignore": ["lm_head", "mtp.layers.0.mlp.experts.0.gate_proj"],
        },
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d, {**a, **b}


def _digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_clip_search_beats_absmax():
    g = torch.Generator().manual_seed(1)
    w = _weight("gate_proj", g).float()
    qa, sa = tool.quantize_rtn(w, search=False)
    qs, ss = tool.quantize_rtn(w, search=True)
    mse_abs = float(((tool.dequantize(qa, sa) - w) ** 2).mean())
    mse_srch = float(((tool.dequantize(qs, ss) - w) ** 2).mean())
    assert mse_srch < 0.9 * mse_abs, (mse_srch, mse_abs)
    # Per group never worse (absmax is one candidate).
    ea = ((tool.dequantize(qa, sa) - w) ** 2).reshape(w.shape[0], -1, 128).sum(-1)
    es = ((tool.dequantize(qs, ss) - w) ** 2).reshape(w.shape[0], -1, 128).sum(-1)
    assert bool((es <= ea + 1e-12).all())


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
    assert tool.main([str(d), str(out), "--dry-run"]) == 0
    assert not out.exists()
    text = capsys.readouterr().out
    assert "would quantize 6 tensors" in text
    for f in ("config.json", "model.safetensors.index.json", "mtp-int4.safetensors"):
        assert str(out / f) in text


def test_writes_three_files_that_compressed_tensors_loads(ckpt, tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationScheme

    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
        CompressedTensorsConfig,
    )

    d, orig = ckpt
    before = _digest(d)
    out = tmp_path / "out"
    assert tool.main([str(d), str(out)]) == 0
    assert _digest(d) == before  # checkpoint untouched
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors.index.json", "mtp-int4.safetensors"]
    )
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert "group_0" in qc["config_groups"]  # existing groups kept
    assert "mtp.layers.0.mlp.experts.0.gate_proj" not in qc["ignore"]
    assert "lm_head" in qc["ignore"]
    wm = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    # Unquantized tensors still point at the original shards.
    assert wm["model.embed_tokens.weight"] == "model-00002-of-00002.safetensors"
    assert wm["mtp.layers.0.mlp.shared_expert.gate_proj.weight"].startswith("model-00001")
    scheme = QuantizationScheme.model_validate(qc["config_groups"][tool.GROUP_NAME])
    with safe_open(str(out / "mtp-int4.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert keys == {k for k, v in wm.items() if v == "mtp-int4.safetensors"}
        for n in MTP:
            assert n not in wm
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
    # vLLM parses the config and maps the MTP experts to the int4 g128 group.
    ct = CompressedTensorsConfig.from_config(qc)
    target = qc["config_groups"][tool.GROUP_NAME]["targets"][0]
    assert target in ct.target_scheme_map
    w_args = ct.target_scheme_map[target]["weights"]
    assert (w_args.num_bits, w_args.group_size, w_args.symmetric) == (4, 128, True)
    import re

    rx = re.compile(target[3:])
    assert all(rx.match(n[: -len(".weight")]) for n in MTP)
    assert not rx.match("mtp.layers.0.mlp.shared_expert.gate_proj")


def test_errors_say_what_to_do(ckpt, tmp_path):
    d, _ = ckpt
    with pytest.raises(SystemExit, match="--pattern"):
        tool.main([str(d), str(tmp_path / "o"), "--pattern", "^nothing$"])
    with pytest.raises(SystemExit, match="differ"):
        tool.main([str(d), str(d)])

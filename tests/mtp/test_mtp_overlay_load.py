"""The MTP variant's weights, end to end on the CPU: a synthetic checkpoint in
the real naming (bf16 MTP experts), scripts/serve-tools/make_mtp_int4.py's overlay
directory, and vLLM's DefaultModelLoader loading the Qwen4Exp MTP draft into
the real INT4 RoutedExperts (patch 0120, VLLM_SAFETENSORS_INDEX_FILTER).

Two layouts, since the real checkpoint's is unknown: MTP experts in a shard
that also holds other weights ("mixed"), and in a shard of their own
("separate"). See mtp_overlay_worker.py for what is real and what stands in.
"""

import json
import re

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

import make_mtp_int4 as tool
import mtp_overlay_worker as w
from pp_ranks import run_ranks

H, I, E, V = w.HIDDEN, w.INTER, w.N_EXPERTS, w.VOCAB
PROJ = ("gate_proj", "up_proj", "down_proj")
EXPERT_NAMES = [f"mtp.layers.0.mlp.experts.{e}.{p}.weight" for e in range(E) for p in PROJ]
# Draft parameter <- checkpoint name, for the non-expert weights compared.
OTHER = {
    "model.fc_embedding.weight": "mtp.fc_embedding.weight",
    "model.layers.0.mlp.gate.weight": "mtp.layers.0.mlp.gate.weight",
    "model.layers.0.mlp.shared_expert.down_proj.weight":
        "mtp.layers.0.mlp.shared_expert.down_proj.weight",
    "model.pre_fc_norm_hidden.weight": "mtp.pre_fc_norm_hidden.weight",
    "model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
}


def _tensors():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    main = {  # target-model weights the draft's loader drops by name
        "model.language_model.embed_tokens.weight": r(V, H),
        "model.language_model.layers.0.mlp.experts.0.gate_proj.weight": r(I, H),
        "model.language_model.norm.weight": r(H),
        "lm_head.weight": r(V, H),
    }
    mtp_other = {
        "mtp.fc_embedding.weight": r(H, H),
        "mtp.fc_hidden.weight": r(H, H),
        "mtp.pre_fc_norm_embedding.weight": r(H),
        "mtp.pre_fc_norm_hidden.weight": r(w.HC * H),
        "mtp.layers.0.self_attn.q_proj.weight": r(2 * 64 * 2, H),
        "mtp.layers.0.self_attn.k_proj.weight": r(64, H),
        "mtp.layers.0.self_attn.v_proj.weight": r(64, H),
        "mtp.layers.0.self_attn.o_proj.weight": r(H, 2 * 64),
        "mtp.layers.0.mlp.gate.weight": r(E, H),
        "mtp.layers.0.mlp.shared_expert_gate.weight": r(1, H),
        "mtp.layers.0.mlp.shared_expert.gate_proj.weight": r(I, H),
        "mtp.layers.0.mlp.shared_expert.up_proj.weight": r(I, H),
        "mtp.layers.0.mlp.shared_expert.down_proj.weight": r(H, I),
    }
    experts = {n: r(H, I) if "down_proj" in n else r(I, H) for n in EXPERT_NAMES}
    return main, mtp_other, experts


LAYOUTS = {
    # shard -> which groups it holds
    "mixed": [("main", "experts_half"), ("mtp_other", "experts_rest")],
    "separate": [("main",), ("mtp_other",), ("experts",)],
}


def _checkpoint(d, layout):
    main, mtp_other, experts = _tensors()
    half = dict(list(experts.items())[: len(experts) // 2])
    groups = {"main": main, "mtp_other": mtp_other, "experts": experts,
              "experts_half": half,
              "experts_rest": {k: v for k, v in experts.items() if k not in half}}
    d.mkdir()
    shards = LAYOUTS[layout]
    wm = {}
    for i, names in enumerate(shards, 1):
        fn = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        part = {k: v for g in names for k, v in groups[g].items()}
        save_file(part, str(d / fn))
        wm.update({k: fn for k in part})
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": wm}))
    # The checkpoint's own quantization: the target INT4 g32; the MTP head
    # ignored with a regex (the case that used to cancel the new group).
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                            "strategy": "group", "group_size": 32}}},
            "ignore": ["lm_head", "re:.*mtp.*"],
        },
    }))
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.fixture(scope="module")
def overlays(tmp_path_factory):
    out = {}
    for layout in LAYOUTS:
        base = tmp_path_factory.mktemp(layout)
        ckpt = _checkpoint(base / "ckpt", layout)
        ov = base / "overlay"
        # Symlinks into the checkpoint's real path, so they resolve here.
        assert tool.main([str(ckpt), str(ov), "--checkpoint-mount", str(ckpt)]) == 0
        out[layout] = (ckpt, ov)
    return out


CASES = [  # (layout, load format, gate)
    ("mixed", "auto", "1"),
    ("mixed", "eager", "1"),
    ("mixed", "multithread", "1"),
    ("mixed", "fastsafetensors", "1"),
    ("separate", "auto", "1"),
    ("mixed", "auto", "0"),
    ("separate", "auto", "0"),
]


@pytest.fixture(scope="module")
def results(overlays):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["vllm.models.qwen4_exp.nvidia.mtp"])
    cases = [
        {"id": f"{lay}-{fmt}-{gate}", "overlay": str(overlays[lay][1]),
         "checkpoint": str(overlays[lay][0]), "format": fmt, "gate": gate,
         "other": OTHER}
        for lay, fmt, gate in CASES
    ]
    return run_ranks(ctx, w.run_rank, 1, cases)[0]


def test_overlay_is_a_model_directory(overlays):
    ckpt, ov = overlays["mixed"]
    assert (ov / "tokenizer.json").is_symlink()
    assert (ov / "model-00001-of-00002.safetensors").resolve() == (
        ckpt / "model-00001-of-00002.safetensors")
    wm = json.loads((ov / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(wm[n] == "mtp-int4.safetensors" for n in EXPERT_NAMES)


@pytest.mark.parametrize("layout,fmt", [(c[0], c[1]) for c in CASES if c[2] == "1"])
def test_draft_loads_int4_experts(results, layout, fmt):
    r = results[f"{layout}-{fmt}-1"]
    assert r["quant_method"] == "CompressedTensorsWNA16MoEMethod"
    assert r["layer_name"] == f"mtp.layers.{w.N_MAIN}.mlp.experts"
    assert r["load"] == "ok", r["load"]
    # Every expert parameter holds mtp-int4.safetensors' values ...
    assert r["equal"] == {"w13_weight_packed": True, "w13_weight_scale": True,
                          "w2_weight_packed": True, "w2_weight_scale": True}
    # ... and only packed tensors reached RoutedExperts.load_weights: no bf16
    # expert weight, each projection of each expert once per suffix.
    reached = r["reached"]
    assert {d for _, d in reached if _.endswith(("weight_packed"))} == {"torch.int32"}
    assert not [n for n, _ in reached if n.endswith(".weight")]
    assert len([n for n, _ in reached if n.endswith("weight_packed")]) == E * 3
    # The draft's other weights came from the checkpoint's shards.
    assert r["other_equal"] and all(r["other_equal"].values()), r["other_equal"]
    if layout == "mixed":
        # One info line: how many superseded tensors, from which shards.
        # (Logged once per distinct message: the first mixed case shows it.)
        if fmt == "auto":
            assert len(r["log"]) == 1, r["log"]
            assert "Skipped 12 superseded tensors" in r["log"][0]
            assert "model-00001-of-00002.safetensors: 6" in r["log"][0]
            assert "model-00002-of-00002.safetensors: 6" in r["log"][0]
    else:
        # The experts' own shard is in no index entry any more: upstream's
        # file filter drops it; nothing is superseded inside a read file.
        assert r["log"] == []


def test_gate_off_reproduces_the_failure(results):
    """VLLM_SAFETENSORS_INDEX_FILTER=0: upstream reads every tensor of every
    indexed shard, the bf16 experts of the mixed shards reach the INT4
    RoutedExperts, and loading fails as it did on the real server."""
    r = results["mixed-auto-0"]
    assert r["load"].startswith("AttributeError"), r["load"]
    # (the first bf16 expert tensor read names w13 or w2, by shard order)
    assert re.search(r"experts has no parameter 'w(13|2)_weight'", r["load"]), r["load"]
    assert any(n.endswith(".weight") and d == "torch.bfloat16" for n, d in r["reached"])
    # Separate shards never needed the filter.
    assert results["separate-auto-0"]["load"] == "ok"


def _two_shards(d, index):
    d.mkdir()
    save_file({"a": torch.zeros(1), "b": torch.zeros(1), "c": torch.zeros(1)}, str(d / "s1.safetensors"))
    save_file({"b": torch.ones(1), "x": torch.ones(1)}, str(d / "s2.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return [str(d / "s1.safetensors"), str(d / "s2.safetensors")]


def test_index_filter_rules(tmp_path, monkeypatch):
    """A tensor is kept in the file its index names, or when the index does
    not list it (upstream); a name-only filter refuses when a superseded
    name is also in its own file (it cannot pick the copy); =0: no filter."""
    from vllm.model_executor.model_loader.weight_utils import SafetensorsIndexFilter as F

    files = _two_shards(tmp_path / "c", {"a": "s1.safetensors", "b": "s2.safetensors",
                                         "x": "s2.safetensors"})
    monkeypatch.setenv("VLLM_SAFETENSORS_INDEX_FILTER", "1")
    f = F.from_index(files, str(tmp_path / "c"), "model.safetensors.index.json")
    s1, s2 = files
    assert [f.keep(s1, n) for n in "abc"] == [True, False, True]
    assert f.keep(s2, "b") and f.keep(s2, "x")
    assert dict(f.skipped) == {s1: 1}
    with pytest.raises(ValueError, match="--load-format safetensors"):
        f.superseded_names("fastsafetensors")  # b: in s1 and in its own s2
    # Superseded and absent from its own file (the overlay's case): by name.
    files = _two_shards(tmp_path / "d", {"a": "s2.safetensors", "x": "s2.safetensors"})
    f = F.from_index(files, str(tmp_path / "d"), "model.safetensors.index.json")
    assert f.superseded_names("instanttensor") == {"a"}
    monkeypatch.setenv("VLLM_SAFETENSORS_INDEX_FILTER", "0")
    assert F.from_index(files, str(tmp_path / "d"), "model.safetensors.index.json") is None

"""0100-ple-pp-mmap on CPU: mmap table output == upstream in-memory table
for random tokens through the real hash kernel (interpreted Triton), the
model-state staging step, the PP input_ids hand-off, weight skipping, and
every refusal/error message, with VLLM_PLE_MMAP_PATH unset and set."""

import inspect
from types import SimpleNamespace

import make_ple_table
import pytest
import numpy as np
import torch
from ple_fixtures import TEXT_CONFIG, table_shards, write_checkpoint

import vllm.models.qwen4_exp.nvidia.ngram_embedding as ne
import vllm.models.qwen4_exp.nvidia.model_state as ms
from vllm import ple_table_format as ptf
from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight
from vllm.models.qwen4_exp.config import Qwen4ExpTextConfig
from vllm.v1.worker.gpu import cudagraph_utils, model_runner
from vllm.v1.worker.gpu.pp_utils import later_pp_rank_input_ids

CONFIG = Qwen4ExpTextConfig(**TEXT_CONFIG)
LAYOUT = ptf.layout_from_config(CONFIG)
MAX_TOKENS = 16
EOS = TEXT_CONFIG["eos_token_id"]
# 0100's MAKE_TABLE_COMMAND (vllm/ple_table_format.py), named in the error
FIX = "python3 scripts/serve-tools/make_ple_table.py --checkpoint DIR --out FILE"


@pytest.fixture(autouse=True)
def single_rank(monkeypatch):
    group = SimpleNamespace(world_size=1, rank_in_group=0)
    monkeypatch.setattr(ne, "get_etp_group", lambda: group)
    monkeypatch.setattr(ne, "get_tp_group", lambda: group)
    monkeypatch.setattr(
        ne, "get_current_vllm_config", lambda: SimpleNamespace(engram_config=None)
    )
    monkeypatch.delenv("VLLM_PLE_MMAP_PATH", raising=False)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    root = tmp_path_factory.mktemp("ple")
    shards = table_shards(LAYOUT, seed=1)
    write_checkpoint(root / "ckpt", shards)
    path = root / "ple.bin"
    assert make_ple_table.main(["--checkpoint", str(root / "ckpt"),
                                "--out", str(path)]) == 0
    return str(path), shards


def build(dense_id):
    layer = LAYOUT.ple_layer_ids[dense_id] - 1
    return ne.Qwen4ExpNGramEmbedding(
        CONFIG, TEXT_CONFIG["ple_embed_dim"], dense_id, MAX_TOKENS,
        data_parallel_rank=0, prefix=f"model.layers.{layer}.ple.ple_embedding",
        params_dtype=torch.bfloat16,
    )


def layer_weights(shards, dense_id):
    layer = LAYOUT.ple_layer_ids[dense_id] - 1
    key = f"layers.{layer}.ple.ple_embedding."
    return [(n.split(key, 1)[1], t) for n, t in shards.items() if key in n]


def random_batch(gen, num_tokens=12):
    # 4 requests (lens 5, 1, 0, 6) + trailing zero-length rows, as the model
    # state lays them out; EOS in the tokens and in the context.
    qsl = torch.tensor([0, 5, 6, 6, num_tokens, num_tokens, num_tokens],
                       dtype=torch.int32)
    ids = torch.randint(0, TEXT_CONFIG["vocab_size"], (num_tokens,),
                        generator=gen, dtype=torch.int32)
    ids[2] = EOS
    ctx = torch.randint(0, TEXT_CONFIG["vocab_size"], (6, 2), generator=gen,
                        dtype=torch.int32)
    ctx[1, 1] = EOS
    return ids, qsl, ctx


@pytest.mark.parametrize("dense_id", [0, 1])
def test_mmap_equals_in_memory_table(table, monkeypatch, dense_id):
    path, shards = table
    upstream = build(dense_id)
    assert isinstance(upstream.ngram_embedding, ne.Qwen4ExpPLEDeviceEmbedding)
    upstream.load_weights(layer_weights(shards, dense_id))

    monkeypatch.setenv("VLLM_PLE_MMAP_PATH", path)
    mapped = build(dense_id)
    emb = mapped.ngram_embedding
    assert isinstance(emb, ne.Qwen4ExpPLEMmapEmbedding)
    assert emb.weight.numel() == 0  # the table is never materialized
    loaded = mapped.load_weights(layer_weights(shards, dense_id))
    assert "ngram_embedding.weight" in loaded
    assert mapped.load_weights([]) == {"ngram_embedding.weight"}  # stripped ckpt
    assert emb.table.shape == (LAYOUT.rows[dense_id], LAYOUT.head_dim)

    gen = torch.Generator().manual_seed(dense_id)
    static_ptr = emb.device_rows.data_ptr()
    for _ in range(3):  # reused staging/device buffers across steps
        ids, qsl, ctx = random_batch(gen)
        hidden = torch.zeros(ids.shape[0], 8)
        want = upstream(hidden, ids, qsl, ctx)  # torch fallback + F.embedding
        mapped.stage_host_rows(ids, qsl, ctx)  # _ple_ngram_ids_kernel
        got = mapped(hidden, ids, qsl, ctx)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert got.data_ptr() == static_ptr  # graphs capture this address
    # a shorter (padded graph size) step reads the prefix of the same buffer
    ids, qsl, ctx = random_batch(gen, num_tokens=8)
    qsl = torch.tensor([0, 5, 6, 6, 8, 8, 8], dtype=torch.int32)
    mapped.stage_host_rows(ids, qsl, ctx)
    want = upstream(torch.zeros(8, 8), ids, qsl, ctx)
    assert torch.equal(mapped(torch.zeros(8, 8), ids, qsl, ctx), want)


def test_mmap_refusals(table, monkeypatch, tmp_path):
    path, _ = table
    missing = tmp_path / "nope.bin"
    monkeypatch.setenv("VLLM_PLE_MMAP_PATH", str(missing))
    with pytest.raises(FileNotFoundError) as exc:
        build(0)
    assert str(missing) in str(exc.value) and FIX in str(exc.value)
    assert f"expected {LAYOUT.file_size} bytes" in str(exc.value)

    monkeypatch.setenv("VLLM_PLE_MMAP_PATH", path)
    group = SimpleNamespace(world_size=2, rank_in_group=0)
    monkeypatch.setattr(ne, "get_etp_group", lambda: group)
    monkeypatch.setattr(ne, "get_tp_group", lambda: group)
    with pytest.raises(NotImplementedError, match="ETP size 1"):
        build(0)


def test_should_skip_table_shards(monkeypatch):
    name = "model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight"
    assert not should_skip_weight(name, None)
    monkeypatch.setenv("VLLM_PLE_MMAP_PATH", "/x")
    assert should_skip_weight(name, None)
    assert not should_skip_weight("model.layers.1.ple.kv_proj.weight", None)


# ---- model state: PP refusal and staging before forward / replay -------------


class _PLEModel(torch.nn.Module):
    def __init__(self, modules):
        super().__init__()
        self.ples = torch.nn.ModuleList(modules)


def _state(monkeypatch, model, pp_size):
    def fake_base_init(self, vllm_config, model, encoder_cache, device):
        self.model_config = vllm_config.model_config
        self.max_num_reqs = 6
        self.device = device

    monkeypatch.setattr(ms.MambaHybridModelState, "__init__", fake_base_init)
    monkeypatch.setattr(ms.MambaHybridModelState, "prepare_inputs",
                        lambda self, ib, rs: {})
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=CONFIG),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp_size),
    )
    return ms.Qwen4ExpModelState(vllm_config, model, None, torch.device("cpu"))


def test_model_state_pp_refusal_unset(monkeypatch):
    with pytest.raises(RuntimeError, match="pipeline_parallel_size=1"):
        _state(monkeypatch, _PLEModel([]), pp_size=3)
    state = _state(monkeypatch, _PLEModel([build(0)]), pp_size=1)
    assert state.host_gathered_ple == []  # upstream: nothing staged


def test_model_state_stages_rows_for_forward(table, monkeypatch):
    path, shards = table
    upstream = build(1)
    upstream.load_weights(layer_weights(shards, 1))
    monkeypatch.setenv("VLLM_PLE_MMAP_PATH", path)
    mapped = build(1)
    # PP=3 is accepted with the mmap table; the rank's PLE layer is found.
    state = _state(monkeypatch, _PLEModel([mapped]), pp_size=3)
    assert state.host_gathered_ple == [mapped]

    gen = torch.Generator().manual_seed(5)
    # two requests, 3 + 1 tokens, one padded token (graph size 5)
    history = torch.randint(0, 1000, (6, 40), generator=gen, dtype=torch.int32)
    num_computed = torch.tensor([9, 0, 0, 0, 0, 4], dtype=torch.int32)
    req_states = SimpleNamespace(
        num_computed_tokens=SimpleNamespace(gpu=num_computed),
        all_token_ids=SimpleNamespace(gpu=history),
    )
    input_ids = torch.randint(0, 1000, (5,), generator=gen, dtype=torch.int32)
    batch = SimpleNamespace(
        num_reqs=2, num_reqs_after_padding=2,
        idx_mapping=torch.tensor([0, 5], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        input_ids=input_ids,
        # host fields of a real InputBatch (decode rows: the kernel path)
        req_ids=["a", "b"], is_prefilling_np=np.array([False, False]),
        query_start_loc_np=np.array([0, 3, 4], dtype=np.int32),
        num_computed_tokens_np=np.array([9, 4], dtype=np.int32),
        prefill_len_np=np.array([9, 4], dtype=np.int32),
        num_tokens_after_padding=5,
    )
    inputs = state.prepare_inputs(batch, req_states)
    qsl, ctx = inputs["query_start_loc"], inputs["ngram_context"]
    assert ctx[0].tolist() == history[0, 7:9].tolist()
    assert ctx[1].tolist() == history[5, 2:4].tolist()
    hidden = torch.zeros(5, 8)
    want = upstream(hidden, input_ids, qsl, ctx)
    got = mapped(hidden, input_ids, qsl, ctx)  # what forward/replay reads
    assert torch.equal(got, want)


# ---- verify_and_update_config: PP refusal and startup file check --------------


def _verify(monkeypatch, pp_size):
    from vllm.model_executor.models import config as mcfg

    monkeypatch.setattr(
        mcfg.Qwen3_5ForConditionalGenerationConfig, "verify_and_update_config",
        staticmethod(lambda vllm_config: None),
    )
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=CONFIG, multimodal_config=None),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp_size,
                                        enable_dbo=False, ubatch_size=1),
        speculative_config=None,
    )
    mcfg.Qwen4ExpForConditionalGenerationConfig.verify_and_update_config(vllm_config)


def test_config_check_unset(monkeypatch):
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=1"):
        _verify(monkeypatch, pp_size=3)
    _verify(monkeypatch, pp_size=1)


def test_config_check_set(table, monkeypatch, tmp_path):
    path, _ = table
    monkeypatch.setenv("VLLM_PLE_MMAP_PATH", path)
    _verify(monkeypatch, pp_size=3)  # PP lifted, file OK
    short = tmp_path / "short.bin"
    short.write_bytes(b"\0" * 320)
    monkeypatch.setenv("VLLM_PLE_MMAP_PATH", str(short))
    with pytest.raises(ValueError) as exc:
        _verify(monkeypatch, pp_size=3)
    text = str(exc.value)
    assert str(short) in text and "actual 320 bytes" in text and FIX in text
    assert f"expected {LAYOUT.file_size} bytes" in text
    monkeypatch.setenv("VLLM_PLE_MMAP_PATH", str(tmp_path / "missing.bin"))
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        _verify(monkeypatch, pp_size=1)


# ---- runner: input_ids for PP ranks > 0 ---------------------------------------


def test_later_pp_rank_input_ids(monkeypatch):
    ids = torch.arange(4)
    ple_model = SimpleNamespace(requires_raw_input_tokens=True)
    other = SimpleNamespace()
    assert later_pp_rank_input_ids(ple_model, ids) is None  # upstream
    monkeypatch.setenv("VLLM_PLE_MMAP_PATH", "/x")
    assert later_pp_rank_input_ids(ple_model, ids) is ids
    assert later_pp_rank_input_ids(other, ids) is None
    from vllm.models.qwen4_exp.nvidia.model import (
        Qwen4ExpForCausalLM,
        Qwen4ExpForConditionalGeneration,
    )

    for cls in (Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration):
        assert later_pp_rank_input_ids(cls, ids) is ids  # the real models keep them


def test_runner_call_sites_use_hand_off():
    # The eager/piecewise path (execute_model) and FULL-graph capture
    # (create_forward_fn inside capture) both route input_ids through it.
    src = inspect.getsource(model_runner.GPUModelRunner.execute_model)
    assert 'later_pp_rank_input_ids(\n                self.model, model_inputs["input_ids"]' in src
    src = inspect.getsource(cudagraph_utils)
    assert 'later_pp_rank_input_ids(\n                    model, model_inputs["input_ids"]' in src
    assert 'model_inputs["input_ids"] = None' not in src


# ---- CUDA only (skips on CPU CI): staging before a FULL graph replay ----------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staged_rows_reach_graph_replay(table, monkeypatch):
    path, shards = table
    gen = torch.Generator().manual_seed(9)
    ids, _, ctx = (t.cuda() for t in random_batch(gen, num_tokens=4))
    steps = [torch.randint(0, 1000, (4,), generator=gen, dtype=torch.int32).cuda()
             for _ in range(3)]
    qsl = torch.tensor([0, 1, 2, 3, 4, 4, 4], dtype=torch.int32).cuda()
    torch.set_default_device("cuda")  # the model is built under target_device
    try:
        upstream = build(0)
        upstream.load_weights([(n, t.cuda()) for n, t in layer_weights(shards, 0)])
        monkeypatch.setenv("VLLM_PLE_MMAP_PATH", path)
        mapped = build(0)
        assert mapped.ngram_embedding.host_rows.is_pinned()
        assert mapped.ngram_embedding.device_rows.is_cuda
        hidden = torch.zeros(4, 8)
        out = torch.empty(4, TEXT_CONFIG["ple_embed_dim"])
        mapped.stage_host_rows(ids, qsl, ctx)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(mapped(hidden, ids, qsl, ctx).float() * 2)
        for step_ids in steps:  # new tokens each step: stage eagerly, replay
            ids.copy_(step_ids)
            mapped.stage_host_rows(ids, qsl, ctx)
            graph.replay()
            want = upstream(hidden, ids, qsl, ctx).float() * 2
            torch.testing.assert_close(out, want, rtol=0, atol=0)
    finally:
        torch.set_default_device("cpu")

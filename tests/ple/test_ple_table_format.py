"""vllm/ple_table_format.py: layout vs the model's own prime layout, row
offsets, the startup file check messages, and torch-free loading."""

import os
import subprocess
import sys

import pytest
from ple_fixtures import TEXT_CONFIG

from vllm import ple_table_format as ptf


def _model_rows(base, heads, dense_id, divisor):
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import (
        Qwen4ExpNGramEmbedding as N,
    )

    _, _, total = N._make_vocab_layout(
        ngram_vocab_size_base=base, ngram_heads=heads, ple_dense_layer_id=dense_id
    )
    return (total + divisor - 1) // divisor * divisor


@pytest.mark.parametrize(
    "base,ngram,per,ids,divisor",
    [(50, 3, 2, [2, 4], 8), (1000, 4, 3, [1, 2, 5], 128), (20_000_000, 3, 8, [1, 3], 128)],
)
def test_layout_matches_model(base, ngram, per, ids, divisor):
    heads = (ngram - 1) * per
    cfg = dict(ple_layer_ids=ids, ngram_size=ngram, heads_per_ngram=per,
               ple_embed_dim=heads * 160, ngram_vocab_size_base=base,
               make_ngram_vocab_size_divisible_by=divisor)
    layout = ptf.layout_from_config(cfg)
    assert layout.rows == tuple(
        _model_rows(base, heads, d, divisor) for d in range(len(ids))
    )
    assert layout.head_dim == 160 and layout.row_bytes == 320
    assert layout.num_heads == heads


def test_production_table_size():
    layout = ptf.layout_from_config(
        {"text_config": {"ple_layer_ids": [7], "ple_embed_dim": 2560}}
    )
    assert layout.rows == (320_001_536,)
    assert layout.file_size == 102_400_491_520  # 95.37 GiB
    assert layout.shard_rows(0) == 625_003


def test_row_byte_offsets():
    layout = ptf.layout_from_config(TEXT_CONFIG)
    assert layout.ple_layer_ids == (2, 4) and layout.dense_id(4) == 1
    r0 = layout.rows[0]
    assert ptf.ple_row_byte_offset(layout, 0, 0) == 0
    assert ptf.ple_row_byte_offset(layout, 0, 5) == 5 * layout.row_bytes
    assert ptf.ple_row_byte_offset(layout, 1, 0) == r0 * layout.row_bytes
    last = ptf.ple_row_byte_offset(layout, 1, layout.rows[1] - 1)
    assert last + layout.row_bytes == layout.file_size
    with pytest.raises(IndexError):
        layout.ple_row_byte_offset(0, r0)
    with pytest.raises(IndexError):
        layout.ple_row_byte_offset(1, -1)


def test_no_ple_layers_is_an_error():
    with pytest.raises(ValueError, match="no ple_layer_ids"):
        ptf.layout_from_config({"ple_layer_ids": []})


def test_shard_names():
    assert ptf.parse_ple_shard_name(
        "model.layers.6.ple.ple_embedding.ngram_embedding.shard_511.weight"
    ) == (7, 511)
    assert ptf.parse_ple_shard_name(
        "model.layers.6.ple.ple_embedding.layer_multipliers") is None
    assert ptf.is_ple_table_weight(
        "model.layers.6.ple.ple_embedding.ngram_embedding.shard_0.weight")
    assert not ptf.is_ple_table_weight("model.layers.6.ple.kv_proj.weight")


def _assert_message(exc, path, layout, actual):
    text = str(exc.value)
    assert repr(str(path)) in text
    assert f"expected {layout.file_size} bytes" in text
    assert actual in text
    assert "python3 scripts/serve-tools/make_ple_table.py --checkpoint DIR --out FILE" in text


def test_check_table_file_errors(tmp_path, monkeypatch):
    layout = ptf.layout_from_config(TEXT_CONFIG)
    path = tmp_path / "ple.bin"
    with pytest.raises(FileNotFoundError) as exc:
        ptf.check_table_file(str(path), layout)
    _assert_message(exc, path, layout, "actual: missing")

    path.write_bytes(b"\0" * (layout.file_size - 1))
    with pytest.raises(ValueError, match="wrong size") as exc:
        ptf.check_table_file(str(path), layout)
    _assert_message(exc, path, layout, f"actual {layout.file_size - 1} bytes")

    path.write_bytes(b"\0" * layout.file_size)
    ptf.check_table_file(str(path), layout)  # right size: no error

    # Tests run as root, where chmod 000 still reads: fake the access check.
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    with pytest.raises(PermissionError, match="not readable") as exc:
        ptf.check_table_file(str(path), layout)
    _assert_message(exc, path, layout, f"actual {layout.file_size} bytes")

    with pytest.raises(FileNotFoundError):  # a directory is not the table
        ptf.check_table_file(str(tmp_path), layout)


def test_loads_without_torch():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('f', {ptf.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['f'] = m\n"
        "spec.loader.exec_module(m)\n"
        "l = m.layout_from_config({'ple_layer_ids': [1], 'ple_embed_dim': 2560,"
        " 'ngram_vocab_size_base': 1000})\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
        "print(l.row_bytes)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "320"

"""scripts/serve-tools/make_ple_table.py: round trip, --verify, --force, error cases."""

import os

import make_ple_table
import pytest
import torch
from ple_fixtures import TEXT_CONFIG, expected_table_bytes, table_shards, write_checkpoint

from vllm import ple_table_format as ptf

LAYOUT = ptf.layout_from_config(TEXT_CONFIG)


def run(*args):
    return make_ple_table.main([str(a) for a in args])


@pytest.fixture
def ckpt(tmp_path):
    shards = table_shards(LAYOUT)
    write_checkpoint(tmp_path / "ckpt", shards)
    return tmp_path / "ckpt", shards


def test_round_trip_and_verify(ckpt, tmp_path, capsys):
    directory, shards = ckpt
    out = tmp_path / "ple.bin"
    # 1 KiB chunks: every shard (840 B .. 1 KiB) and the file go through the
    # chunk loop more than once.
    assert run("--checkpoint", directory, "--out", out, "--chunk-kib", "1") == 0
    data = out.read_bytes()
    assert len(data) == LAYOUT.file_size
    assert data == expected_table_bytes(LAYOUT, shards)
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    # row r of layer d is at ple_row_byte_offset and equals the checkpoint row
    name = next(n for n in shards if "layers.3." in n and n.endswith("shard_2.weight"))
    row = 2 * LAYOUT.shard_rows(1) + 3
    off = ptf.ple_row_byte_offset(LAYOUT, 1, row)
    assert data[off:off + LAYOUT.row_bytes] == (
        shards[name][3].view(torch.int16).numpy().tobytes())
    capsys.readouterr()
    assert run("--checkpoint", directory, "--out", out, "--verify") == 0
    assert "OK:" in capsys.readouterr().out


def test_verify_detects_corruption_and_size(ckpt, tmp_path, capsys):
    directory, _ = ckpt
    out = tmp_path / "ple.bin"
    assert run("--checkpoint", directory, "--out", out) == 0
    data = bytearray(out.read_bytes())
    off = ptf.ple_row_byte_offset(LAYOUT, 1, LAYOUT.shard_rows(1) + 1)
    data[off] ^= 0xFF
    out.write_bytes(bytes(data))
    capsys.readouterr()
    assert run("--checkpoint", directory, "--out", out, "--verify") == 1
    err = capsys.readouterr().err
    assert "MISMATCH" in err and "PLE layer 4 shard 1" in err and "--force" in err
    out.write_bytes(bytes(data[:-1]))
    assert run("--checkpoint", directory, "--out", out, "--verify") == 2
    err = capsys.readouterr().err
    assert "wrong size" in err and f"expected {LAYOUT.file_size}" in err


def test_refuses_overwrite_without_force(ckpt, tmp_path, capsys):
    directory, shards = ckpt
    out = tmp_path / "ple.bin"
    out.write_bytes(b"keep")
    assert run("--checkpoint", directory, "--out", out) == 2
    assert "--force" in capsys.readouterr().err
    assert out.read_bytes() == b"keep"
    assert run("--checkpoint", directory, "--out", out, "--force") == 0
    assert out.read_bytes() == expected_table_bytes(LAYOUT, shards)


def test_checkpoint_without_table(tmp_path, capsys):
    write_checkpoint(tmp_path / "c", {})
    assert run("--checkpoint", tmp_path / "c", "--out", tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "has no PLE table tensors" in err and "ngram_embedding.shard_K" in err
    assert not (tmp_path / "o").exists()

    write_checkpoint(tmp_path / "d", {}, text_config=dict(TEXT_CONFIG, ple_layer_ids=[]))
    assert run("--checkpoint", tmp_path / "d", "--out", tmp_path / "o") == 2
    assert "no ple_layer_ids" in capsys.readouterr().err

    assert run("--checkpoint", tmp_path / "none", "--out", tmp_path / "o") == 2
    assert "no config.json" in capsys.readouterr().err


def test_missing_or_misshaped_shard(tmp_path, capsys):
    shards = table_shards(LAYOUT)
    name = sorted(shards)[1]
    partial = {n: t for n, t in shards.items() if n != name}
    write_checkpoint(tmp_path / "c", partial)
    assert run("--checkpoint", tmp_path / "c", "--out", tmp_path / "o") == 2
    assert "lacks 1 PLE table shard" in capsys.readouterr().err
    bad = dict(shards)
    bad[name] = bad[name][:-1]
    write_checkpoint(tmp_path / "d", bad)
    assert run("--checkpoint", tmp_path / "d", "--out", tmp_path / "o") == 2
    assert "has shape" in capsys.readouterr().err


def test_float32_shards_round_like_torch(tmp_path):
    shards = table_shards(LAYOUT, dtype=torch.float32)
    write_checkpoint(tmp_path / "c", shards)
    out = tmp_path / "ple.bin"
    assert run("--checkpoint", tmp_path / "c", "--out", out, "--chunk-kib", "1") == 0
    assert out.read_bytes() == expected_table_bytes(LAYOUT, shards)


def test_help_and_closing_hint_without_heavy_imports(ckpt, tmp_path):
    """--help works where numpy, tqdm, torch and vllm are missing (a bare python3),
    and the closing hint names what compose users set (PLE_TABLE)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(make_ple_table.__file__)
    block = ("import runpy, sys\n"
             "for m in ('numpy', 'tqdm', 'torch', 'vllm'): sys.modules[m] = None\n"
             f"sys.argv = [{str(script)!r}, '--help']\n"
             f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--checkpoint" in r.stdout, r.stderr
    directory, _ = ckpt
    out = tmp_path / "ple.bin"
    r = subprocess.run([sys.executable, str(script), "--checkpoint", str(directory), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"PLE_TABLE={out}" in r.stdout and f"VLLM_PLE_MMAP_PATH={out}" in r.stdout

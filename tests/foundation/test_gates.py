"""Gates: every patch names a VLLM_* switch that the series declares in
vllm/envs.py; the engine logs one line with every patch on/off; README's
gates table is generated from the headers and kept in sync."""

from __future__ import annotations

import importlib
import logging
import re
import types
from pathlib import Path

import pytest

import vllm_patches as vp

REPO = Path(__file__).resolve().parents[2]
SERIES = vp.load_series()


def declared_gates() -> dict[str, str]:
    """gate -> name of the patch that declares it in envs.py (both places)."""
    decl = vp.envs_gates(SERIES)
    for name, patch in decl.items():
        added = next(p for p in SERIES if p.name == patch).added_lines("vllm/envs.py")
        assert re.search(rf"^\s+{name}: ", added, re.M), (
            f"{patch}: {name} is in environment_variables but not declared in the TYPE_CHECKING block")
    return decl


@pytest.mark.parametrize("patch", SERIES, ids=[p.name for p in SERIES])
def test_header_fields_and_gate_declared(patch):
    f = patch.fields
    assert re.fullmatch(r"\d{4}-[a-z0-9][a-z0-9.-]*\.patch", patch.name)
    assert f.get("Description"), f"{patch.name}: no Description"
    assert f.get("Spec"), f"{patch.name}: no Spec"
    assert patch.gate, f"{patch.name}: no 'Gate: VLLM_...'"
    decl = declared_gates()
    assert patch.gate in decl, f"{patch.name}: gate {patch.gate} is not declared in envs.py by any patch"
    order = [p.name for p in SERIES]
    assert order.index(decl[patch.gate]) <= order.index(patch.name), (
        f"{patch.gate} is declared by {decl[patch.gate]}, after {patch.name} uses it")


def test_series_numbers_ascend_with_gaps():
    nums = [int(p.name[:4]) for p in SERIES]
    assert nums == sorted(nums) and len(set(nums)) == len(nums)
    assert all(n % 10 == 0 for n in nums)


def test_installed_envs_declares_every_gate():
    import vllm.envs as envs

    for p in SERIES:
        if p.gate not in envs.environment_variables:
            pytest.skip("this vllm does not carry the series (run scripts/test.sh)")
    for g in declared_gates():
        assert g in envs.environment_variables


def test_gates_line_on_and_off(monkeypatch):
    pg = importlib.import_module("vllm.patch_gates")
    manifest = {"series": [{"name": p.name, "gate": p.gate} for p in SERIES]}
    monkeypatch.setenv("VLLM_PATCH_GATES_LOG", "1")
    on = pg.format_gates_line(pg.gate_states(manifest))
    assert on.startswith(f"vllm-3x3090 patches ({len(SERIES)}): ")
    assert "0010-patch-gates[VLLM_PATCH_GATES_LOG]=on" in on
    monkeypatch.setenv("VLLM_PATCH_GATES_LOG", "0")
    off = pg.format_gates_line(pg.gate_states(manifest))
    assert "0010-patch-gates[VLLM_PATCH_GATES_LOG]=off" in off
    assert pg.format_gates_line([]) .endswith("none applied (upstream vLLM)")


class _Stop(Exception):
    pass


def _engine_core_log(monkeypatch, value: str) -> list[str]:
    import vllm.envs as envs
    from vllm.v1.engine import core

    monkeypatch.setenv("VLLM_PATCH_GATES_LOG", value)
    if hasattr(envs.__getattr__, "cache_clear"):
        envs.disable_envs_cache()
    records: list[str] = []

    class H(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())

    h = H()
    core.logger.addHandler(h)
    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_rank_local=1))

    def executor(_cfg):
        raise _Stop

    try:
        with pytest.raises(_Stop):
            core.EngineCore(cfg, executor, log_stats=False)
    finally:
        core.logger.removeHandler(h)
    return [r for r in records if r.startswith("vllm-3x3090 patches")]


def test_engine_start_logs_gates_line(monkeypatch):
    import vllm.envs as envs

    if "VLLM_PATCH_GATES_LOG" not in envs.environment_variables:
        pytest.skip("this vllm does not carry the series (run scripts/test.sh)")
    lines = _engine_core_log(monkeypatch, "1")
    assert len(lines) == 1
    assert _engine_core_log(monkeypatch, "0") == []


def test_readme_gates_table_in_sync():
    text = (REPO / "README.md").read_text()
    a = text.index(vp.README_BEGIN) + len(vp.README_BEGIN)
    b = text.index(vp.README_END)
    assert text[a:b] == "\n" + vp.gates_table(), (
        "README gates table is stale: run `python3 scripts/vllm_patches.py gates --update-readme README.md`")
    for p in SERIES:
        assert f"`{p.gate}`" in text[a:b]

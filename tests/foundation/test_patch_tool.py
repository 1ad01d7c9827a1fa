"""scripts/vllm_patches.py on real trees: the pristine 0.30.0 wheel unpacked
(hard-linked copies; the tool writes by temp + rename, so the shared pristine
copy is never modified through a link) and the repository's real series."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import vllm_patches as vp

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def pristine() -> Path:
    return vp.pristine_cache(log=lambda *a: None)


def linked_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns(".ok"))
    return dst


@pytest.fixture
def target(pristine, tmp_path) -> vp.Target:
    return vp.Target(linked_copy(pristine, tmp_path / "site"))


def record_ok(t: vp.Target, rels) -> list[str]:
    rec = t.record()
    return [r for r in rels if vp.record_digest((t.root / r).read_bytes()) != rec[r]]


def write_series(d: Path, patches: dict[str, bytes]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, raw in patches.items():
        (d / name).write_bytes(raw)
    (d / "series").write_text("".join(n + "\n" for n in patches))
    return d


def real_patches() -> dict[str, bytes]:
    return {p.name: p.raw for p in vp.load_series(vp.PATCH_DIR)}


def test_pristine_tree_applies_and_checks(target):
    m = vp.apply_series(target, log=lambda *a: None)
    assert m["state"] == "complete"
    assert [e["name"] for e in m["series"]] == [p.name for p in vp.load_series()]
    assert all(e["gate"].startswith("VLLM_") for e in m["series"])
    vp.check_applied(target)
    # Each touched .py was byte-compiled.
    for rel, digest in m["files"].items():
        if digest and rel.endswith(".py"):
            p = target.root / rel
            assert list((p.parent / "__pycache__").glob(p.stem + ".*.pyc")), rel


def test_second_apply_refused(target):
    vp.apply_series(target, log=lambda *a: None)
    with pytest.raises(vp.PatchError, match="already applied"):
        vp.apply_series(target, log=lambda *a: None)


def test_modified_base_file_refused_by_name(target):
    existing, _ = vp.base_files(vp.load_series())
    victim = existing[0]
    p = target.root / victim
    data = p.read_bytes()
    p.unlink()  # break the hard link before writing
    p.write_bytes(data + b"\n# local edit\n")
    with pytest.raises(vp.PatchError, match=victim.replace(".", r"\.")):
        vp.apply_series(target, log=lambda *a: None)
    assert not target.manifest_path.exists()


def test_wrong_version_refused(target):
    meta = target.dist_info() / "METADATA"
    text = meta.read_text().replace("Version: 0.30.0", "Version: 0.29.1", 1)
    meta.unlink()
    meta.write_text(text)
    with pytest.raises(vp.PatchError, match=r"installed vllm is 0\.29\.1.*0\.30\.0"):
        vp.apply_series(target, log=lambda *a: None)


def _shift_first_hunk(raw: bytes, by: int) -> bytes:
    text = raw.decode()
    i = text.index("\n@@ -") + 1
    j = text.index(" @@", i)
    old, new = text[i + 4:j].split(" +")
    o, oc = old.split(",")
    n, nc = new.split(",")
    hdr = f"@@ -{int(o) + by},{oc} +{int(n) + by},{nc}"
    return (text[:i] + hdr + text[j:]).encode()


def test_offset_refused_though_git_accepts_it(target, tmp_path):
    patches = real_patches()
    first = next(iter(patches))
    shifted = dict(patches)
    shifted[first] = _shift_first_hunk(patches[first], 2)
    d = write_series(tmp_path / "p", shifted)
    # git apply takes it (at an offset): the exact-position rule is ours.
    r = subprocess.run(["git", "apply", "--check", "-p1", str(d / first)], cwd=target.root,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with pytest.raises(vp.PatchError, match="offsets and fuzz are refused"):
        vp.apply_series(target, d, log=lambda *a: None)
    assert not target.manifest_path.exists()
    assert record_ok(target, vp.base_files(vp.load_series(d))[0]) == []


def test_fuzz_refused_and_nothing_written(target, tmp_path):
    """One context line of a hunk differs from the tree (what `patch -F1`
    would still apply): refused, and nothing written."""
    patches = real_patches()
    first = next(iter(patches))
    text = patches[first].decode()
    i = text.index("\n@@ -") + 1
    k = text.index("\n ", i) + 1  # first context line of the first hunk
    fuzzed = (text[:k] + " # not the upstream line" + text[text.index("\n", k):]).encode()
    d = write_series(tmp_path / "p", {first: fuzzed})
    with pytest.raises(vp.PatchError, match="does not match"):
        vp.apply_series(target, d, log=lambda *a: None)
    assert not target.manifest_path.exists()
    existing, created = vp.base_files(vp.load_series(d))
    assert record_ok(target, existing) == []
    assert not any((target.root / c).exists() for c in created)


def test_dry_run_covers_whole_series(target, tmp_path):
    """Good first patch, broken second: nothing may be written."""
    patches = real_patches()
    first = next(iter(patches))
    broken = _shift_first_hunk(patches[first], 5)
    d = write_series(tmp_path / "p", {**patches, "9990-broken.patch": broken})
    with pytest.raises(vp.PatchError):
        vp.apply_series(target, d, log=lambda *a: None)
    existing, created = vp.base_files(vp.load_series(vp.PATCH_DIR))
    assert record_ok(target, existing) == []
    assert not any((target.root / c).exists() for c in created)
    assert not target.manifest_path.exists()


def test_half_applied_tree_refused(target):
    target.manifest_dir.mkdir(parents=True)
    target.manifest_path.write_text(json.dumps({"state": "applying", "series": []}))
    with pytest.raises(vp.PatchError, match="half-applied"):
        vp.apply_series(target, log=lambda *a: None)


def test_check_names_a_modified_patched_file(target):
    m = vp.apply_series(target, log=lambda *a: None)
    rel = next(r for r, d in m["files"].items() if d)
    p = target.root / rel
    data = p.read_bytes()
    p.unlink()
    p.write_bytes(data + b"# drift\n")
    with pytest.raises(vp.PatchError, match=rel.replace(".", r"\.")):
        vp.check_applied(target)


def test_check_detects_other_series(target, tmp_path):
    vp.apply_series(target, log=lambda *a: None)
    patches = real_patches()
    first = next(iter(patches))
    d = write_series(tmp_path / "p", {first: patches[first] + b"\n"})
    with pytest.raises(vp.PatchError, match="series differs"):
        vp.check_applied(target, d)


def test_reverse_apply_restores_record_hashes(target):
    m = vp.apply_series(target, log=lambda *a: None)
    existing, created = vp.base_files(vp.load_series())
    assert record_ok(target, existing) != [] or not existing
    vp.revert_series(target, log=lambda *a: None)
    assert record_ok(target, existing) == []
    assert not any((target.root / c).exists() for c in created)
    assert not target.manifest_dir.exists()
    # ... and it applies again afterwards.
    vp.apply_series(target, log=lambda *a: None)
    assert len(m["series"]) == len(vp.load_series())


def test_tree_export_round_trip_is_byte_stable(tmp_path):
    tree = tmp_path / "tree"
    vp.make_tree(tree, log=lambda *a: None)
    log = vp.git(tree, "log", "--format=%s", "pristine..HEAD").decode().split()
    assert list(reversed(log)) == [Path(p.name).stem for p in vp.load_series()]
    out = tmp_path / "exported"
    shutil.copytree(vp.PATCH_DIR, out)
    vp.export_tree(tree, out, log=lambda *a: None)
    files = lambda d: {f.name: f.read_bytes() for f in d.iterdir() if f.is_file()}  # noqa: E731
    assert files(out) == files(vp.PATCH_DIR)
    # Twice: nothing changes.
    before = files(out)
    vp.export_tree(tree, out, log=lambda *a: None)
    assert files(out) == before


def test_export_of_an_edit_updates_only_that_patch(tmp_path):
    tree = tmp_path / "tree"
    vp.make_tree(tree, log=lambda *a: None)
    out = tmp_path / "exported"
    shutil.copytree(vp.PATCH_DIR, out)
    f = tree / "vllm" / "patch_gates.py"
    f.write_text(f.read_text() + "\n# edited\n")
    first = vp.git(tree, "rev-list", "--reverse", "pristine..HEAD").decode().split()[0]
    vp.git(tree, "add", "-A")
    vp.git(tree, "commit", "-q", f"--fixup={first}")
    vp.git(tree, "-c", "sequence.editor=true", "rebase", "-q", "-i", "--autosquash", "pristine")
    written = []
    vp.export_tree(tree, out, log=written.append)
    assert written == ["wrote 0010-patch-gates.patch"]
    assert b"+# edited" in (out / "0010-patch-gates.patch").read_bytes()


def test_fetch_refuses_a_wrong_sha(tmp_path):
    name, _ = vp.pinned_wheel()
    (tmp_path / name).write_bytes(b"not the wheel")
    with pytest.raises(vp.PatchError, match="sha256 .* != pinned"):
        vp.fetch_wheel(tmp_path, log=lambda *a: None)


def test_cli_apply_check_and_refusal_exit_codes(target):
    run = lambda *a: subprocess.run(["python3", str(REPO / "scripts" / "vllm_patches.py"), *a],
                                    capture_output=True, text=True)
    r = run("apply", "--check", str(target.root))
    assert r.returncode == 2 and "not patched" in r.stderr
    assert run("apply", str(target.root / "vllm")).returncode == 0
    r = run("apply", "--check", str(target.root))
    assert r.returncode == 0 and "unmodified" in r.stdout
    r = run("apply", str(target.root))
    assert r.returncode == 2 and "already applied" in r.stderr


def test_combine_merges_parallel_series(tmp_path):
    """Two dirs that each carry part of the series, as parallel branches do
    (b's later patches were made without a's, so their line numbers differ),
    combine into the full series, byte-identical on export."""
    names = [p.name for p in vp.load_series()]
    if len(names) < 3:
        pytest.skip("needs a series of 3 patches or more")
    # a: all but the last patch; b: the first and the last, as if the last
    # had been made on a branch that only had the first (so the last patch
    # must not depend on the ones between: today 0650 only needs 0010).
    half = len(names) - 1
    a = write_series(tmp_path / "a", {n: (vp.PATCH_DIR / n).read_bytes() for n in names[:half]})
    tree_b = tmp_path / "tb"
    vp.make_tree(tree_b, log=lambda *a: None)
    commits = vp.git(tree_b, "rev-list", "--reverse", "pristine..HEAD").decode().split()
    vp.git(tree_b, "rebase", "-q", "--onto", commits[0], commits[half - 1], "series")
    b = tmp_path / "b"
    vp.export_tree(tree_b, b, log=lambda *a: None)
    assert (b / "series").read_text().split() == names[:1] + names[half:]
    assert any((b / n).read_bytes() != (vp.PATCH_DIR / n).read_bytes() for n in names[half:]), \
        "b's patches should carry other line numbers (else this test proves nothing)"
    out = tmp_path / "combined"
    picked = vp.combine_trees(out, [a, b], log=lambda *a: None)
    assert picked == [Path(n).stem for n in names]
    exported = tmp_path / "exported"
    vp.export_tree(out, exported, log=lambda *a: None)
    for n in names:
        assert (exported / n).read_bytes() == (vp.PATCH_DIR / n).read_bytes(), n


def _syntax_error_patch() -> bytes:
    """A patch that creates a module with a SyntaxError (after the real series)."""
    return (b"Description: broken on purpose\nGate: VLLM_PATCH_GATES_LOG\n---\n"
            b"diff --git a/vllm/_broken_by_test.py b/vllm/_broken_by_test.py\nnew file mode 100644\n"
            b"--- /dev/null\n+++ b/vllm/_broken_by_test.py\n@@ -0,0 +1,2 @@\n+x = 1\n+def (:\n")


def test_syntax_error_refused_before_anything_is_written(target, tmp_path):
    d = write_series(tmp_path / "p", {**real_patches(), "9990-broken.patch": _syntax_error_patch()})
    with pytest.raises(vp.PatchError, match=r"_broken_by_test\.py line 2: does not compile.*9990-broken"):
        vp.apply_series(target, d, log=lambda *a: None)
    existing, created = vp.base_files(vp.load_series(d))
    assert record_ok(target, existing) == []
    assert not any((target.root / c).exists() for c in created)
    assert not target.manifest_path.exists()


def test_interrupted_apply_is_reverted(target, monkeypatch):
    """An apply that dies half-way (here: the 3rd file write) leaves a tree that
    `revert` restores; `apply` names both ways out."""
    real_write = vp.Target.write
    n = {"w": 0}

    def dying_write(self, rel, text):
        n["w"] += 1
        if n["w"] == 3:
            raise KeyboardInterrupt
        return real_write(self, rel, text)

    monkeypatch.setattr(vp.Target, "write", dying_write)
    with pytest.raises(KeyboardInterrupt):
        vp.apply_series(target, log=lambda *a: None)
    monkeypatch.setattr(vp.Target, "write", real_write)
    with pytest.raises(vp.PatchError, match=r"half-applied.*revert.*pip install --force-reinstall --no-deps"):
        vp.apply_series(target, log=lambda *a: None)
    existing, created = vp.base_files(vp.load_series())
    assert record_ok(target, existing) != []  # two files were written
    vp.revert_series(target, log=lambda *a: None)
    assert record_ok(target, existing) == []
    assert not any((target.root / c).exists() for c in created)
    assert not target.manifest_dir.exists()
    vp.apply_series(target, log=lambda *a: None)
    vp.check_applied(target)


def _edit_first_added_line(raw: bytes) -> bytes:
    lines = raw.split(b"\n")
    k = next(i for i, ln in enumerate(lines) if ln.startswith(b"+") and not ln.startswith(b"+++"))
    lines[k] += b"  # edited on a branch"
    return b"\n".join(lines)


def test_combine_stops_when_one_patch_really_differs(tmp_path):
    patches = real_patches()
    first = next(iter(patches))
    a = write_series(tmp_path / "a", patches)
    moved = write_series(tmp_path / "moved", {**patches, first: _shift_first_hunk(patches[first], 2)})
    b = write_series(tmp_path / "b", {**patches, first: _edit_first_added_line(patches[first])})
    c = write_series(tmp_path / "c", {**patches, first: _edit_first_added_line(_edit_first_added_line(
        patches[first]))})
    # other line numbers only: one patch, no question asked (the later copy)
    assert vp.choose_copies([a, moved], log=lambda *x: None)[first] == 1
    with pytest.raises(vp.PatchError, match="differs between the dirs") as e:
        vp.choose_copies([a, b], log=lambda *x: None)
    msg = str(e.value)
    assert str(a / first) in msg and str(b / first) in msg and "--take" in msg and "--prefer-changed" in msg
    assert vp.choose_copies([a, b], take={first.removesuffix(".patch"): b}, log=lambda *x: None)[first] == 1
    assert vp.choose_copies([b, a], take={first: b}, log=lambda *x: None)[first] == 0
    # the base (first dir) and one branch that edited it: --prefer-changed takes the edit,
    # also when another branch still has the base's copy (later in the list)
    assert vp.choose_copies([a, b, moved], prefer_changed=True, log=lambda *x: None)[first] == 1
    # two branches edited it differently: still a stop
    with pytest.raises(vp.PatchError, match="3 different copies"):
        vp.choose_copies([a, b, c], prefer_changed=True, log=lambda *x: None)
    with pytest.raises(vp.PatchError, match="no dir's series has"):
        vp.choose_copies([a, b], take={"9999-nope": b}, log=lambda *x: None)
    # the CLI stops before building anything
    out = tmp_path / "combined"
    r = subprocess.run(["python3", str(REPO / "scripts" / "vllm_patches.py"), "combine", str(out), str(a), str(b)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and str(b / first) in r.stderr and not out.exists()

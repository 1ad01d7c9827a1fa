#!/usr/bin/env python3
"""vllm-3x3090 patch tool: fetch, tree, export, apply, revert.

The series in patches/ is applied against the pinned vLLM 0.30.0 wheel tree.
Everything here is stdlib Python (plus git for `tree`/`export`), because the
`apply` step runs inside the vllm/vllm-openai image, which we do not want to
extend with extra tooling.

Commands
  fetch            download the pinned wheel (no deps) and verify its sha256
  tree DIR         unpack the wheel's vllm/ into DIR as a git repo: commit 1 is
                   pristine 0.30.0, then one commit per patch of patches/series
  export DIR       write DIR's commits back to patches/NNNN-name.patch + series
  apply TARGET     apply the series to an installed vllm (site-packages dir or
                   the vllm/ package dir); `--check` verifies instead
  revert TARGET    reverse-apply what the manifest says was applied
  combine OUT DIR...  a tree whose series is the union of several patch dirs
                   (parallel branches), cherry-picked in numeric order; stops when
                   one patch really differs between dirs (--take / --prefer-changed)
  gates            print the gates table (markdown) from the patch headers

Why our own applier instead of `patch`/`git apply`: both accept hunks at an
offset (git silently, GNU patch with "offset N lines"), and a patch that lands
a few lines away from where it was written is exactly the silent breakage a
pinned series must refuse.  Here a hunk applies only at its stated line with
all context equal, or the whole series is refused before anything is written.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PIN_VERSION = "0.30.0"
REPO_ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = REPO_ROOT / "patches"
WHEEL_PIN_FILE = PATCH_DIR / "vllm-wheel.sha256"
MANIFEST_DIRNAME = "_vllm_3x3090"  # inside the vllm package
MANIFEST_NAME = "manifest.json"
PRISTINE_SUBJECT = f"vllm {PIN_VERSION} pristine (wheel)"


class PatchError(Exception):
    """A refusal. The message says what is wrong and what to do."""


def cache_dir() -> Path:
    root = os.environ.get("VLLM_3X3090_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-3x3090"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record_digest(data: bytes) -> str:
    """Digest in the wheel RECORD format (urlsafe base64, no padding)."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


# --------------------------------------------------------------------------
# Unified diff parsing and strict application
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Hunk:
    old_start: int
    old_count: int
    new_start: int
    new_count: int
    # (tag, text) with tag in " -+"; text includes its line ending, except
    # where the diff said "\ No newline at end of file".
    lines: list[tuple[str, str]]

    def reversed(self) -> "Hunk":
        swap = {" ": " ", "-": "+", "+": "-"}
        return Hunk(self.new_start, self.new_count, self.old_start, self.old_count,
                    [(swap[t], s) for t, s in self.lines])


@dataclasses.dataclass
class FilePatch:
    old_path: str | None  # None: file is created
    new_path: str | None  # None: file is deleted
    hunks: list[Hunk]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path  # type: ignore[return-value]

    def reversed(self) -> "FilePatch":
        return FilePatch(self.new_path, self.old_path, [h.reversed() for h in self.hunks])


@dataclasses.dataclass
class Patch:
    name: str
    raw: bytes
    header: str
    files: list[FilePatch]

    @property
    def fields(self) -> dict[str, str]:
        return parse_header_fields(self.header)

    @property
    def gate(self) -> str:
        return gate_name(self.fields.get("Gate", ""))

    @property
    def sha256(self) -> str:
        return sha256_bytes(self.raw)

    def added_lines(self, path: str) -> str:
        """The lines this patch adds to one file, joined."""
        return "".join(s for fp in self.files if fp.path == path
                       for h in fp.hunks for t, s in h.lines if t == "+")


ENVS_ENTRY_RE = re.compile(r'^\s+"(VLLM_[A-Z0-9_]+)":', re.M)


def envs_gates(patches: list["Patch"]) -> dict[str, str]:
    """VLLM_* variables the series adds to envs.py's environment_variables
    -> the name of the patch that adds each."""
    return {name: p.name for p in patches
            for name in ENVS_ENTRY_RE.findall(p.added_lines("vllm/envs.py"))}


_HUNK_RE = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_prefix(p: bytes) -> str | None:
    s = p.decode("utf-8").rstrip("\n").split("\t")[0]
    if s == "/dev/null":
        return None
    if s.startswith(("a/", "b/")):
        return s[2:]
    raise PatchError(f"path {s!r} has no a/ or b/ prefix (patches are -p1)")


def split_lines(data):
    """Split on "\n" only, keeping it (str/bytes .splitlines() also splits on
    \r, \f and others, which diff does not)."""
    nl = b"\n" if isinstance(data, bytes) else "\n"
    parts = data.split(nl)
    out = [x + nl for x in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def split_header(raw: bytes) -> tuple[str, bytes]:
    idx = raw.find(b"\ndiff --git ")
    if raw.startswith(b"diff --git "):
        return "", raw
    if idx < 0:
        raise PatchError("no 'diff --git' section found")
    header = raw[: idx + 1].decode("utf-8")
    if header.endswith("---\n"):
        header = header[: -len("---\n")]
    return header, raw[idx + 1:]


def parse_patch(name: str, raw: bytes) -> Patch:
    header, body = split_header(raw)
    lines = split_lines(body)
    files: list[FilePatch] = []
    i = 0
    cur: FilePatch | None = None
    while i < len(lines):
        line = lines[i]
        if line.startswith(b"diff --git "):
            cur = None
            i += 1
            continue
        if line.startswith(b"GIT binary patch") or line.startswith(b"Binary files "):
            raise PatchError(f"{name}: binary patches are not supported")
        if line.startswith(b"--- "):
            if i + 1 >= len(lines) or not lines[i + 1].startswith(b"+++ "):
                raise PatchError(f"{name}: '---' line without '+++' at line {i + 1}")
            cur = FilePatch(_strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:]), [])
            files.append(cur)
            i += 2
            continue
        m = _HUNK_RE.match(line)
        if m:
            if cur is None:
                raise PatchError(f"{name}: hunk outside a file section at line {i + 1}")
            os_, oc, ns, nc = m.groups()
            hunk = Hunk(int(os_), int(oc) if oc is not None else 1,
                        int(ns), int(nc) if nc is not None else 1, [])
            i += 1
            need_old, need_new = hunk.old_count, hunk.new_count
            while need_old > 0 or need_new > 0:
                if i >= len(lines):
                    raise PatchError(f"{name}: truncated hunk in {cur.path}")
                hl = lines[i]
                tag = chr(hl[0]) if hl else ""
                if hl in (b"\n",):  # some editors strip the space of empty context lines
                    tag, hl = " ", b" \n"
                if tag not in " -+":
                    raise PatchError(f"{name}: malformed hunk line {i + 1} in {cur.path}: {hl[:40]!r}")
                text = hl[1:].decode("utf-8")
                hunk.lines.append((tag, text))
                if tag in " -":
                    need_old -= 1
                if tag in " +":
                    need_new -= 1
                i += 1
                if i < len(lines) and lines[i].startswith(b"\\ No newline"):
                    t, s = hunk.lines[-1]
                    hunk.lines[-1] = (t, s[:-1] if s.endswith("\n") else s)
                    i += 1
            if need_old < 0 or need_new < 0:
                raise PatchError(f"{name}: hunk line counts do not match its header in {cur.path}")
            cur.hunks.append(hunk)
            continue
        i += 1  # index, mode and other extended header lines
    if not files:
        raise PatchError(f"{name}: no file changes found")
    return Patch(name, raw, header, files)


def apply_hunks(text: str | None, fp: FilePatch, where: str) -> str | None:
    """Apply fp's hunks to text exactly: no offset, no fuzz. Returns new text."""
    if fp.old_path is None:
        if text is not None:
            raise PatchError(f"{where}: creates {fp.path}, which already exists")
        old_lines: list[str] = []
    else:
        if text is None:
            raise PatchError(f"{where}: {fp.path} does not exist")
        old_lines = split_lines(text)
    out: list[str] = []
    pos = 0  # index into old_lines
    for h in fp.hunks:
        start = h.old_start - 1 if h.old_count > 0 else h.old_start
        if start < pos:
            raise PatchError(f"{where}: overlapping hunks in {fp.path}")
        expected = [s for t, s in h.lines if t in " -"]
        actual = old_lines[start:start + len(expected)]
        if actual != expected:
            # Find the first differing line to name it.
            for k, (a, e) in enumerate(zip(actual + [None] * len(expected), expected)):
                if a != e:
                    break
            raise PatchError(
                f"{where}: hunk @@ -{h.old_start},{h.old_count} @@ does not match {fp.path} "
                f"exactly at line {start + k + 1} (expected {e!r}, found {a!r}); "
                "offsets and fuzz are refused: regenerate the patch against the pristine tree")
        out.extend(old_lines[pos:start])
        out.extend(s for t, s in h.lines if t in " +")
        pos = start + len(expected)
    out.extend(old_lines[pos:])
    if fp.new_path is None:
        if out:
            raise PatchError(f"{where}: deletes {fp.path} but leaves content behind")
        return None
    return "".join(out)


def load_series(patch_dir: Path = PATCH_DIR) -> list[Patch]:
    series_file = patch_dir / "series"
    if not series_file.exists():
        raise PatchError(f"{series_file} not found")
    patches = []
    for line in series_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split()[0]
        p = patch_dir / name
        if not p.exists():
            raise PatchError(f"series names {name}, which is not in {patch_dir}")
        if len(line.split()) > 1:
            raise PatchError(f"series line {line!r}: options (like -p0) are not supported; use -p1 patches")
        patches.append(parse_patch(name, p.read_bytes()))
    return patches


def parse_header_fields(header: str) -> dict[str, str]:
    """DEP-3 style: 'Field: value' with continuation lines starting with a space."""
    fields: dict[str, str] = {}
    key = None
    for line in header.splitlines():
        if line.startswith((" ", "\t")) and key:
            fields[key] += "\n" + line.strip()
        elif re.match(r"^[A-Za-z][A-Za-z0-9-]*:", line):
            key, _, val = line.partition(":")
            fields[key] = val.strip()
        else:
            key = None
    return fields


def gate_name(gate_field: str) -> str:
    m = re.match(r"(VLLM_[A-Z0-9_]+)", gate_field.strip())
    return m.group(1) if m else ""


# --------------------------------------------------------------------------
# Installed tree: version, RECORD, manifest
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    root: Path  # directory that contains vllm/ (site-packages or a tree)

    @classmethod
    def resolve(cls, path: str | Path) -> "Target":
        p = Path(path).resolve()
        if (p / "vllm" / "__init__.py").exists():
            return cls(p)
        if p.name == "vllm" and (p / "__init__.py").exists():
            return cls(p.parent)
        raise PatchError(f"{path}: no vllm package here (give site-packages or the vllm/ dir)")

    def dist_info(self) -> Path:
        cands = sorted(self.root.glob("vllm-*.dist-info"))
        if not cands:
            raise PatchError(f"{self.root}: no vllm-*.dist-info next to vllm/; reinstall: `{reinstall_cmd()}`")
        if len(cands) > 1:
            raise PatchError(f"{self.root}: several vllm dist-info dirs ({', '.join(c.name for c in cands)}); "
                             f"reinstall cleanly: `{reinstall_cmd()}`")
        return cands[0]

    def version(self) -> str:
        meta = self.dist_info() / "METADATA"
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
        raise PatchError(f"{meta}: no Version field")

    def record(self) -> dict[str, str]:
        rec: dict[str, str] = {}
        for line in (self.dist_info() / "RECORD").read_text().splitlines():
            parts = line.rsplit(",", 2)
            if len(parts) == 3 and parts[1].startswith("sha256="):
                rec[parts[0]] = parts[1][len("sha256="):]
        return rec

    @property
    def manifest_dir(self) -> Path:
        return self.root / "vllm" / MANIFEST_DIRNAME

    @property
    def manifest_path(self) -> Path:
        return self.manifest_dir / MANIFEST_NAME

    def read(self, rel: str) -> str | None:
        p = self.root / rel
        if not p.exists():
            return None
        return p.read_bytes().decode("utf-8")

    def write(self, rel: str, text: str | None) -> None:
        p = self.root / rel
        if text is None:
            if p.exists():
                p.unlink()
            return
        p.parent.mkdir(parents=True, exist_ok=True)
        # temp + rename: never a half-written file, and hard-linked copies of
        # a pristine tree (as the tests use) are not modified through the link.
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
        if p.exists():
            shutil.copymode(p, tmp)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, p)


def check_version(target: Target) -> None:
    v = target.version()
    if v != PIN_VERSION:
        raise PatchError(
            f"installed vllm is {v}, the series is for {PIN_VERSION}: "
            f"use the vllm/vllm-openai:v{PIN_VERSION} image or pip install vllm=={PIN_VERSION}")


def simulate(patches: list[Patch], read, reverse: bool = False) -> dict[str, str | None]:
    """Apply the series in memory (dry run). Returns final contents of touched files."""
    state: dict[str, str | None] = {}
    seq = list(reversed(patches)) if reverse else patches
    for p in seq:
        fps = [fp.reversed() for fp in p.files] if reverse else p.files
        for fp in fps:
            src = fp.old_path or fp.path
            if src not in state:
                state[src] = read(src)
            new = apply_hunks(state[src], fp, p.name)
            if fp.old_path and fp.new_path and fp.old_path != fp.new_path:
                state[fp.old_path] = None
            state[fp.path] = new
    return state


def base_files(patches: list[Patch]) -> tuple[list[str], list[str]]:
    """(files the series modifies that exist in the wheel, files it creates)."""
    created: list[str] = []
    existing: list[str] = []
    for p in patches:
        for fp in p.files:
            if fp.old_path is None:
                if fp.path not in created:
                    created.append(fp.path)
            elif fp.old_path not in created and fp.old_path not in existing:
                existing.append(fp.old_path)
    return existing, created


def verify_base(target: Target, patches: list[Patch]) -> None:
    record = target.record()
    existing, created = base_files(patches)
    bad = []
    for rel in existing:
        if rel not in record:
            raise PatchError(f"{rel}: touched by the series but not in the wheel RECORD")
        data = (target.root / rel).read_bytes() if (target.root / rel).exists() else None
        if data is None:
            bad.append(f"{rel} (missing)")
        elif record_digest(data) != record[rel]:
            bad.append(rel)
    for rel in created:
        if (target.root / rel).exists():
            bad.append(f"{rel} (created by the series, but already present)")
    if bad:
        raise PatchError(
            "these files differ from the pristine vllm 0.30.0 wheel (RECORD sha256): "
            + ", ".join(bad)
            + f"; reinstall with `pip install --force-reinstall --no-deps vllm=={PIN_VERSION}`"
            " (or rebuild from the base image) and apply again")


def apply_series(target: Target, patch_dir: Path = PATCH_DIR, log=print) -> dict:
    manifest_path = target.manifest_path
    if manifest_path.exists():
        m = json.loads(manifest_path.read_text())
        if m.get("state") != "complete":
            raise PatchError(
                f"{target.root}: half-applied tree (manifest state {m.get('state')!r}): "
                f"`{Path(sys.argv[0]).name} revert {target.root}` restores it, or reinstall with "
                f"`{reinstall_cmd()}`; then apply again")
        raise PatchError(
            f"{target.root}: the series is already applied ({len(m['series'])} patches, "
            f"see {manifest_path}); use `apply --check` to verify it or `revert` first")
    check_version(target)
    patches = load_series(patch_dir)
    verify_base(target, patches)
    # Dry run of the whole series before anything is written, compile included:
    # a patch that leaves a SyntaxError is refused with the tree untouched.
    final = simulate(patches, target.read)
    compile_in_memory(final, patches, target)
    manifest = {
        "tool": "vllm-3x3090 scripts/vllm_patches.py",
        "base": f"vllm {PIN_VERSION}",
        "state": "applying",
        "series": [
            {"name": p.name, "sha256": p.sha256, "gate": p.gate,
             "description": p.fields.get("Description", "").split("\n")[0],
             "files": [fp.path for fp in p.files]}
            for p in patches
        ],
        # The final digests are known before writing: `revert` can restore a
        # tree that an interrupted apply left half-written.
        "files": {rel: (sha256_bytes(text.encode()) if text is not None else None)
                  for rel, text in sorted(final.items())},
    }
    target.manifest_dir.mkdir(parents=True, exist_ok=True)
    _write_json(manifest_path, manifest)
    for p in patches:  # copies, so `revert` works without this repository
        (target.manifest_dir / p.name).write_bytes(p.raw)
    for rel, text in final.items():
        target.write(rel, text)
    for rel, text in final.items():
        if text is not None and rel.endswith(".py"):
            try:
                py_compile.compile(str(target.root / rel), doraise=True)
            except py_compile.PyCompileError as e:  # compiled in memory above: not expected
                raise PatchError(f"{rel}: does not compile after patching: {e.msg}; "
                                 f"`revert {target.root}` restores the tree") from e
    manifest["state"] = "complete"
    _write_json(manifest_path, manifest)
    log(f"applied {len(patches)} patches to {target.root} (vllm {PIN_VERSION}); manifest {manifest_path}")
    for p in patches:
        log(f"  {p.name}  gate {p.gate or '-'}")
    return manifest


def reinstall_cmd() -> str:
    return f"pip install --force-reinstall --no-deps vllm=={PIN_VERSION}"


def compile_in_memory(final: dict[str, str | None], patches: list[Patch], target: Target) -> None:
    """Compile every patched .py from memory; PatchError naming the file, the
    line and the patches that touch it, before anything is written."""
    for rel, text in sorted(final.items()):
        if text is None or not rel.endswith(".py"):
            continue
        try:
            compile(text, str(target.root / rel), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as e:
            who = [p.name for p in patches if any(fp.path == rel for fp in p.files)]
            where = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
            raise PatchError(f"{rel}{where}: does not compile after patching ({e.__class__.__name__}: "
                             f"{getattr(e, 'msg', e)}); touched by {', '.join(who)}. Nothing was written; "
                             "fix the patch in the development tree and export again") from e


def check_applied(target: Target, patch_dir: Path | None = PATCH_DIR) -> dict:
    check_version(target)
    if not target.manifest_path.exists():
        raise PatchError(f"{target.root}: not patched (no {target.manifest_path})")
    m = json.loads(target.manifest_path.read_text())
    if m.get("state") != "complete":
        raise PatchError(f"{target.root}: half-applied tree (manifest state {m.get('state')!r}): "
                         f"`revert {target.root}` restores it, or reinstall with `{reinstall_cmd()}`")
    problems = []
    for rel, digest in m["files"].items():
        p = target.root / rel
        if digest is None:
            if p.exists():
                problems.append(f"{rel} (should have been deleted)")
        elif not p.exists():
            problems.append(f"{rel} (missing)")
        elif sha256_file(p) != digest:
            problems.append(rel)
    if patch_dir is not None:
        patches = load_series(patch_dir)
        want = [(p.name, p.sha256) for p in patches]
        have = [(e["name"], e["sha256"]) for e in m["series"]]
        if want != have:
            problems.append(f"series differs from {patch_dir} (applied: {[n for n, _ in have]})")
    if problems:
        raise PatchError("patched tree does not match its manifest: " + ", ".join(problems))
    return m


def revert_series(target: Target, log=print) -> None:
    if not target.manifest_path.exists():
        raise PatchError(f"{target.root}: not patched (no manifest)")
    m = json.loads(target.manifest_path.read_text())
    if m.get("state") != "complete":
        revert_half_applied(target, m, log)
        return
    check_applied(target, patch_dir=None)
    patches = [parse_patch(e["name"], (target.manifest_dir / e["name"]).read_bytes()) for e in m["series"]]
    final = simulate(patches, target.read, reverse=True)
    record = target.record()
    for rel, text in final.items():
        if text is not None and rel in record and record_digest(text.encode()) != record[rel]:
            raise PatchError(f"{rel}: reverse-apply does not restore the RECORD hash")
    for rel, text in final.items():
        target.write(rel, text)
        if text is None:
            cache = target.root / Path(rel).parent / "__pycache__"
            for pyc in cache.glob(Path(rel).stem + ".*.pyc") if cache.exists() else []:
                pyc.unlink()
    shutil.rmtree(target.manifest_dir)
    log(f"reverted {len(patches)} patches in {target.root}")


def revert_half_applied(target: Target, m: dict, log=print) -> None:
    """Restore a tree an interrupted apply left half-written: each touched
    file is pristine (RECORD), patched (the manifest's digest: reverse-applied)
    or foreign (refused, named)."""
    if not m.get("files"):
        raise PatchError(f"{target.root}: half-applied tree from an older apply (no file digests in "
                         f"{target.manifest_path}); reinstall with `{reinstall_cmd()}` and apply again")
    patches = [parse_patch(e["name"], (target.manifest_dir / e["name"]).read_bytes()) for e in m["series"]]
    record = target.record()
    to_reverse, to_delete, bad = set(), [], []
    for rel, digest in m["files"].items():
        p = target.root / rel
        data = p.read_bytes() if p.exists() else None
        if rel in record:
            if data is not None and record_digest(data) == record[rel]:
                continue  # not written yet
            if data is not None and digest is not None and sha256_bytes(data) == digest:
                to_reverse.add(rel)
            elif data is None and digest is None:
                to_reverse.add(rel)  # deleted by the series: reverse-apply recreates it
            else:
                bad.append(rel)
        elif data is not None:  # created by the series
            if digest is not None and sha256_bytes(data) == digest:
                to_delete.append(rel)
            else:
                bad.append(rel)
    if bad:
        raise PatchError(f"{target.root}: half-applied tree with files that are neither pristine nor "
                         f"patched: {', '.join(bad)}; reinstall with `{reinstall_cmd()}` and apply again")
    only = [Patch(p.name, p.raw, p.header, [fp for fp in p.files if fp.path in to_reverse]) for p in patches]
    final = simulate([p for p in only if p.files], target.read, reverse=True)
    for rel, text in final.items():
        if text is None or record_digest(text.encode()) != record.get(rel):
            raise PatchError(f"{rel}: reverse-apply does not restore the RECORD hash; reinstall with "
                             f"`{reinstall_cmd()}`")
    for rel, text in final.items():
        target.write(rel, text)
    for rel in to_delete:
        (target.root / rel).unlink()
    shutil.rmtree(target.manifest_dir)
    log(f"reverted a half-applied series in {target.root} ({len(final)} files restored, "
        f"{len(to_delete)} removed)")


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------
# Wheel fetch and the git development tree
# --------------------------------------------------------------------------


def pinned_wheel() -> tuple[str, str]:
    digest, name = WHEEL_PIN_FILE.read_text().split()[:2]
    return name, digest


def fetch_wheel(dest: Path | None = None, log=print) -> Path:
    name, digest = pinned_wheel()
    dest = dest or (cache_dir() / "wheel")
    dest.mkdir(parents=True, exist_ok=True)
    whl = dest / name
    if not whl.exists():
        log(f"downloading vllm=={PIN_VERSION} (no deps) into {dest} ...")
        env = dict(os.environ)
        # pip's find-links may hold a local wheel that sorts above the pin.
        empty = tempfile.mkdtemp(prefix="vllm3x-nolinks-")
        env["PIP_FIND_LINKS"] = empty
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--only-binary=:all:", "-d", str(dest), f"vllm=={PIN_VERSION}"], env=env)
        if r.returncode != 0 or not whl.exists():
            raise PatchError(f"pip download vllm=={PIN_VERSION} failed or did not produce {name}")
    got = sha256_file(whl)
    if got != digest:
        raise PatchError(f"{whl}: sha256 {got} != pinned {digest} ({WHEEL_PIN_FILE}); "
                         "delete the file and fetch again, or check where pip downloads from")
    return whl


def unpack_pristine(dest: Path, whl: Path) -> None:
    with zipfile.ZipFile(whl) as z:
        members = [n for n in z.namelist() if n.startswith("vllm/") or
                   (n.startswith(f"vllm-{PIN_VERSION}.dist-info/"))]
        z.extractall(dest, members)


def pristine_cache(log=print) -> Path:
    """A pristine unpacked wheel tree, shared read-only by tests and `tree`."""
    whl = fetch_wheel(log=log)
    root = cache_dir() / f"pristine-{sha256_file(whl)[:16]}"
    if not (root / ".ok").exists():
        tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix="pristine.tmp."))
        unpack_pristine(tmp, whl)
        (tmp / ".ok").write_text("ok\n")
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)
    return root


def git(cwd: Path, *args: str, input: bytes | None = None) -> bytes:
    env = dict(os.environ, GIT_AUTHOR_NAME="vllm-3x3090", GIT_AUTHOR_EMAIL="dev@vllm-3x3090.invalid",
               GIT_COMMITTER_NAME="vllm-3x3090", GIT_COMMITTER_EMAIL="dev@vllm-3x3090.invalid",
               GIT_AUTHOR_DATE="2026-01-01T00:00:00Z", GIT_COMMITTER_DATE="2026-01-01T00:00:00Z")
    r = subprocess.run(["git", "-c", "core.autocrlf=false", "-c", "core.safecrlf=false", *args],
                       cwd=cwd, input=input, capture_output=True, env=env)
    if r.returncode != 0:
        raise PatchError(f"git {' '.join(args)}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


def make_tree(dest: Path, patch_dir: Path = PATCH_DIR, log=print) -> None:
    if dest.exists() and any(dest.iterdir()):
        raise PatchError(f"{dest} exists and is not empty")
    src = pristine_cache(log=log)
    log(f"copying pristine vllm {PIN_VERSION} into {dest} ...")
    shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".ok"))
    git(dest, "init", "-q", "-b", "series")
    (dest / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", PRISTINE_SUBJECT)
    git(dest, "tag", "pristine")
    patches = load_series(patch_dir)
    target = Target(dest)
    for p in patches:
        final = simulate([p], target.read)
        for rel, text in final.items():
            target.write(rel, text)
        git(dest, "add", "-A")
        msg = Path(p.name).stem + "\n\n" + p.header
        git(dest, "commit", "-q", "--allow-empty", "--cleanup=verbatim", "-F", "-", input=msg.encode())
    log(f"tree {dest}: tag 'pristine' + {len(patches)} commits on branch 'series'.")
    log("Edit, `git commit` (subject = NNNN-name, body = the DEP-3 header), then `export`.")


DIFF_ARGS = ["-c", "diff.noprefix=false", "-c", "diff.mnemonicprefix=false", "-c", "core.quotepath=off",
             "diff", "--no-color", "--no-ext-diff", "--no-renames", "--full-index",
             "--diff-algorithm=myers", "-U3", "--src-prefix=a/", "--dst-prefix=b/"]


def export_tree(src: Path, patch_dir: Path = PATCH_DIR, log=print) -> list[str]:
    commits = git(src, "rev-list", "--reverse", "pristine..HEAD").decode().split()
    names = []
    outputs: dict[str, bytes] = {}
    for c in commits:
        raw = git(src, "cat-file", "commit", c)
        msg = raw.split(b"\n\n", 1)[1].decode()
        subject, _, body = msg.partition("\n\n")
        subject = subject.strip()
        if not re.fullmatch(r"\d{4}-[a-z0-9][a-z0-9.-]*", subject):
            raise PatchError(f"commit {c[:12]}: subject {subject!r} is not NNNN-name")
        if not gate_name(parse_header_fields(body).get("Gate", "")):
            raise PatchError(f"commit {c[:12]} ({subject}): header has no 'Gate: VLLM_...' line")
        diff = git(src, *DIFF_ARGS, f"{c}~1", c, "--", ".", ":(exclude).gitignore")
        if not diff:
            raise PatchError(f"commit {c[:12]} ({subject}) changes nothing")
        name = subject + ".patch"
        if body and not body.endswith("\n"):
            body += "\n"
        outputs[name] = body.encode() + b"---\n" + diff
        names.append(name)
    patch_dir.mkdir(parents=True, exist_ok=True)
    for old in patch_dir.glob("[0-9][0-9][0-9][0-9]-*.patch"):
        if old.name not in outputs:
            old.unlink()
            log(f"removed {old.name}")
    for name, data in outputs.items():
        p = patch_dir / name
        if not p.exists() or p.read_bytes() != data:
            p.write_bytes(data)
            log(f"wrote {name}")
    series = "".join(n + "\n" for n in names)
    sp = patch_dir / "series"
    if not sp.exists() or sp.read_text() != series:
        sp.write_text(series)
        log("wrote series")
    return names


def patch_identity(raw: bytes) -> tuple:
    """What a patch changes, without what moves when it is rebased: its header
    and, per file, the removed/added lines (no hunk positions, context lines or
    index blob ids). Two copies with the same identity are the same patch made
    on different bases."""
    p = parse_patch("x", raw)
    return (p.header.strip(),
            tuple((fp.old_path, fp.new_path, tuple((t, x) for h in fp.hunks for t, x in h.lines if t != " "))
                  for fp in p.files))


def choose_copies(patch_dirs: list[Path], take: dict[str, Path] | None = None,
                  prefer_changed: bool = False, log=print) -> dict[str, int]:
    """Patch name -> index of the dir whose copy combine uses. Copies that
    differ only by their base (line numbers, context) are one patch (the later
    dir's copy is used). Copies that really differ stop the combine
    (PatchError naming every file) unless --take NAME=DIR picks one, or
    prefer_changed and exactly one copy differs from the first dir's (the
    base: the one branch that edited the patch)."""
    take = {(k if k.endswith(".patch") else k + ".patch"): Path(v).resolve() for k, v in (take or {}).items()}
    versions: dict[str, list[tuple[int, tuple]]] = {}
    for i, d in enumerate(patch_dirs):
        for p in load_series(d):
            versions.setdefault(p.name, []).append((i, patch_identity(p.raw)))
    unknown = set(take) - set(versions)
    if unknown:
        raise PatchError(f"--take names {', '.join(sorted(unknown))}, which no dir's series has")
    chosen: dict[str, int] = {}
    conflicts = []
    for name, vs in sorted(versions.items()):
        distinct = list(dict.fromkeys(ident for _, ident in vs))
        if name in take:
            idx = [i for i, _ in vs if patch_dirs[i].resolve() == take[name]]
            if not idx:
                raise PatchError(f"--take {name}={take[name]}: that dir is not one of the combined dirs "
                                 f"or has no {name} (it is in: {', '.join(str(patch_dirs[i]) for i, _ in vs)})")
            chosen[name] = idx[-1]
            if len(distinct) > 1:
                log(f"{name}: copies differ; using {patch_dirs[idx[-1]] / name} (--take)")
            continue
        if len(distinct) == 1:
            chosen[name] = vs[-1][0]
            continue
        base = vs[0][1] if vs[0][0] == 0 else None
        changed = [ident for ident in distinct if ident != base]
        if prefer_changed and base is not None and len(changed) == 1:
            chosen[name] = next(i for i, ident in vs if ident == changed[0])
            log(f"{name}: copies differ; using the one copy changed from the base: "
                f"{patch_dirs[chosen[name]] / name} (--prefer-changed)")
            continue
        groups = []
        for ident in distinct:
            groups.append(" = ".join(str(patch_dirs[i] / name) for i, x in vs if x == ident))
        conflicts.append(f"{name}: {len(distinct)} different copies: " + " | ".join(groups))
    if conflicts:
        raise PatchError(
            "the same patch differs between the dirs (not only in line numbers or context), and combine "
            "keeps one copy per patch, it cannot merge two edits of one patch:\n  " + "\n  ".join(conflicts)
            + "\nPick the copy to keep with --take NAME=DIR (repeatable), or --prefer-changed (keep the one copy "
            "that differs from the first dir's, when only one does); to keep two edits, apply one on a `tree` "
            "of the other and export")
    return chosen


def combine_trees(dest: Path, patch_dirs: list[Path], log=print, take: dict[str, Path] | None = None,
                  prefer_changed: bool = False) -> list[str]:
    """A tree whose series is the union of several patch dirs, by patch name,
    cherry-picked on pristine in numeric order. A patch whose copies really
    differ between the dirs stops it before anything is built (see
    choose_copies: --take / --prefer-changed).

    This is how branches that each grew their own patches merge: git's 3-way
    cherry-pick re-derives the line numbers that the strict applier needs
    (a patch made beside another one in the same file no longer applies at
    its stated lines). Tree building is deterministic (fixed author/dates), so
    every source tree shares the same pristine commit. On a conflict the tree
    is left mid-cherry-pick for you to resolve (`git cherry-pick --continue`).
    """
    if dest.exists() and any(dest.iterdir()):
        raise PatchError(f"{dest} exists and is not empty")
    chosen = choose_copies(patch_dirs, take, prefer_changed, log=log)
    picks: dict[str, tuple[int, str]] = {}
    for i, d in enumerate(patch_dirs):
        if i == 0:
            make_tree(dest, d, log=lambda *a: None)
            git(dest, "branch", "src-0", "series")
        else:
            src = Path(tempfile.mkdtemp(prefix=f"vllm3x-combine-{i}-"))
            make_tree(src, d, log=lambda *a: None)
            git(dest, "fetch", "-q", str(src), f"series:src-{i}")
            shutil.rmtree(src)
        for c in git(dest, "rev-list", "--reverse", f"pristine..src-{i}").decode().split():
            subject = git(dest, "log", "-1", "--format=%s", c).decode().strip()
            if chosen.get(subject + ".patch", i) == i:
                picks[subject] = (i, c)
    git(dest, "checkout", "-q", "-B", "series", "refs/tags/pristine")
    for subject in sorted(picks):
        i, c = picks[subject]
        try:
            git(dest, "cherry-pick", "--allow-empty", c)
        except PatchError as e:
            raise PatchError(f"{subject} (from {patch_dirs[i]}) conflicts in {dest}: resolve, "
                             f"`git cherry-pick --continue`, pick the rest ({', '.join(sorted(picks))}), "
                             f"then export. {e}") from e
        log(f"picked {subject} from {patch_dirs[i]}")
    return sorted(picks)


def spec_items(spec_field: str) -> str:
    """The item ids of a Spec: field (decode-04, ttft-01, pinned-pool ...),
    without its section numbers and tracker references, which a clone of the
    repository cannot follow (the README stays self-contained)."""
    return ", ".join(dict.fromkeys(re.findall(r"\b[a-z][a-z0-9]*(?:-[a-z0-9]+)+\b", spec_field)))


def gates_table(patch_dir: Path = PATCH_DIR) -> str:
    rows = ["| patch | gate | default | item | what |", "|---|---|---|---|---|"]
    for p in load_series(patch_dir):
        f = p.fields
        gate_field = f.get("Gate", "")
        default = "on (`=0` restores upstream)"
        m = re.search(r"\((.*)\)", gate_field)
        if m:
            default = m.group(1)
        desc = f.get("Description", "").split("\n")[0].replace("|", "\\|")
        rows.append(f"| `{Path(p.name).stem}` | `{p.gate}` | {default} | {spec_items(f.get('Spec', ''))} | {desc} |")
    return "\n".join(rows) + "\n"


def is_opt_in(p: Patch) -> bool:
    return "opt-in" in p.fields.get("Gate", "")


def compose_ab(patch_dir: Path = PATCH_DIR) -> str:
    """compose/ab.yaml: pass every default-on gate through from the shell/.env."""
    lines = [
        "# A/B variant, generated by `scripts/vllm_patches.py gates --compose-ab compose/ab.yaml`:",
        "# every default-on gate of the series passes through from your shell or .env",
        "# (unset = on). Turn one patch off for a run:",
        "#   <GATE>=0 docker compose -f compose.yaml -f compose/ab.yaml up -d",
        "services:",
        "  vllm:",
        "    environment:",
    ]
    for p in load_series(patch_dir):
        if p.gate and not is_opt_in(p):
            lines.append(f'      {p.gate}: "${{{p.gate}:-1}}"')
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- gates-table:begin (generated by scripts/vllm_patches.py gates --update-readme) -->"
README_END = "<!-- gates-table:end -->"


def update_readme(readme: Path, patch_dir: Path = PATCH_DIR) -> bool:
    text = readme.read_text()
    a, b = text.index(README_BEGIN), text.index(README_END)
    new = text[: a + len(README_BEGIN)] + "\n" + gates_table(patch_dir) + text[b:]
    if new != text:
        readme.write_text(new)
        return True
    return False


# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--patches", type=Path, default=PATCH_DIR, help="patch directory (default: %(default)s)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="download and verify the pinned wheel")
    t = sub.add_parser("tree", help="make a git development tree")
    t.add_argument("dir", type=Path)
    e = sub.add_parser("export", help="export a development tree's commits to patches/")
    e.add_argument("dir", type=Path)
    c = sub.add_parser("combine", help="tree = union of several patch dirs, in numeric order")
    c.add_argument("dir", type=Path)
    c.add_argument("patch_dirs", type=Path, nargs="+")
    c.add_argument("--take", action="append", default=[], metavar="PATCH=DIR",
                   help="when PATCH's copies differ between the dirs, use DIR's (repeatable)")
    c.add_argument("--prefer-changed", action="store_true",
                   help="when a patch's copies differ, use the one copy that differs from the first dir's "
                        "(the base), if only one does")
    a = sub.add_parser("apply", help="apply the series to an installed vllm")
    a.add_argument("target", help="site-packages dir (containing vllm/) or the vllm/ package dir")
    a.add_argument("--check", action="store_true", help="verify an applied tree against its manifest")
    r = sub.add_parser("revert", help="reverse-apply the recorded series")
    r.add_argument("target")
    g = sub.add_parser("gates", help="print the gates table from the patch headers")
    g.add_argument("--update-readme", type=Path, metavar="README", help="rewrite the table in README")
    g.add_argument("--compose-ab", type=Path, metavar="YAML", help="write the A/B compose variant")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fetch":
            print(fetch_wheel())
        elif args.cmd == "tree":
            make_tree(args.dir.resolve(), args.patches)
        elif args.cmd == "combine":
            take = {}
            for kv in args.take:
                k, sep, v = kv.partition("=")
                if not sep or not k or not v:
                    raise PatchError(f"--take {kv!r}: give PATCH=DIR, e.g. 0100-ple-pp-mmap=../b/patches")
                take[k] = Path(v)
            combine_trees(args.dir.resolve(), [d.resolve() for d in args.patch_dirs], take=take,
                          prefer_changed=args.prefer_changed)
        elif args.cmd == "export":
            export_tree(args.dir.resolve(), args.patches)
        elif args.cmd == "apply":
            target = Target.resolve(args.target)
            if args.check:
                m = check_applied(target, args.patches)
                print(f"ok: {target.root} carries the series ({len(m['series'])} patches) unmodified")
            else:
                apply_series(target, args.patches)
        elif args.cmd == "revert":
            revert_series(Target.resolve(args.target))
        elif args.cmd == "gates":
            if args.compose_ab:
                args.compose_ab.write_text(compose_ab(args.patches))
                print(f"wrote {args.compose_ab}")
            if args.update_readme:
                changed = update_readme(args.update_readme, args.patches)
                print(("updated " if changed else "unchanged ") + str(args.update_readme))
            if not (args.update_readme or args.compose_ab):
                sys.stdout.write(gates_table(args.patches))
    except PatchError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""sm_86 (RTX 3090) compile check for Triton kernels, without a GPU.

Every kernel the series adds registers each launch config it uses and the
tests assert ``metadata.shared <= SM86_MAX_SHARED``: a config over the limit
compiles fine on the H200 we test on (228 KiB) and fails only at launch on
the 3090 (``out of resource: shared memory``).

Specialise like a real launch: pointers and ints that are 16-byte aligned at
run time get the ``tt.divisibility`` attribute (``aligned=...``), otherwise
Triton skips software pipelining and under-reports shared memory (a
128x256x64, 4-stage tl.dot reads 48 KiB without the attrs and 144 KiB with
them; see tests/test_sm86.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SM86_MAX_SHARED = 101_376  # bytes per block on sm_86 (99 KiB opt-in)


@dataclasses.dataclass
class Compiled:
    name: str
    shared: int
    num_warps: int
    num_stages: int


def _locate(fn) -> tuple[str, str]:
    inner = getattr(fn, "fn", fn)  # JITFunction / InterpretedFunction -> python function
    return inner.__module__, inner.__name__


def compile_many(configs: list[dict]) -> list[Compiled]:
    """Compile several configs in one clean subprocess.

    The test session runs with TRITON_INTERPRET=1 (see conftest.py), under
    which @triton.jit yields interpreter objects that triton.compile cannot
    take; so the compile runs in a child without it, importing each kernel
    by module and name.
    """
    jobs = []
    for c in configs:
        mod, name = _locate(c["fn"])
        jobs.append({"module": mod, "name": name, "signature": c["signature"],
                     "constexprs": c.get("constexprs") or {}, "aligned": list(c.get("aligned", ())),
                     "num_warps": c.get("num_warps", 4), "num_stages": c.get("num_stages", 3)})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *sys.path])
    r = subprocess.run([sys.executable, __file__], input=json.dumps(jobs), capture_output=True,
                       text=True, env=env, timeout=1200)
    if r.returncode != 0:
        raise RuntimeError(f"sm_86 compile failed:\n{r.stderr[-4000:]}")
    return [Compiled(**d) for d in json.loads(r.stdout.strip().splitlines()[-1])]


def compile_sm86(fn, signature: dict[str, str], constexprs: dict[str, Any] | None = None,
                 aligned=(), num_warps: int = 4, num_stages: int = 3) -> Compiled:
    """Compile ``fn`` (a @triton.jit function at module level) for sm_86.

    signature: {arg: triton type} for every non-constexpr argument, e.g.
    ``{"x_ptr": "*bf16", "n": "i32"}``; constexpr args go in ``constexprs``.
    aligned: argument names that are 16-byte aligned / divisible by 16 at run time.
    """
    return compile_many([dict(fn=fn, signature=signature, constexprs=constexprs, aligned=aligned,
                              num_warps=num_warps, num_stages=num_stages)])[0]


def check_fits(c: Compiled, what: str = "") -> Compiled:
    assert c.shared <= SM86_MAX_SHARED, (
        f"{c.name} {what} warps={c.num_warps} stages={c.num_stages}: "
        f"{c.shared} B shared memory > {SM86_MAX_SHARED} B (sm_86 limit)")
    return c


def assert_fits_sm86(fn, signature, constexprs=None, aligned=(), num_warps=4, num_stages=3) -> Compiled:
    return check_fits(compile_sm86(fn, signature, constexprs, aligned, num_warps, num_stages),
                      str(constexprs or ""))


def _child() -> None:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = []
    for j in json.loads(sys.stdin.read()):
        fn = getattr(importlib.import_module(j["module"]), j["name"])
        sig = dict(j["signature"])
        for k in j["constexprs"]:
            sig[k] = "constexpr"
        missing = [a for a in fn.arg_names if a not in sig]
        if missing:
            raise SystemExit(f"{j['name']}: no signature for {missing}")
        sig = {a: sig[a] for a in fn.arg_names}
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in j["aligned"]}
        src = ASTSource(fn, signature=sig, constexprs=j["constexprs"], attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 86, 32),
                           options={"num_warps": j["num_warps"], "num_stages": j["num_stages"]})
        out.append({"name": j["name"], "shared": int(k.metadata.shared),
                    "num_warps": j["num_warps"], "num_stages": j["num_stages"]})
    print(json.dumps(out))


if __name__ == "__main__":
    _child()

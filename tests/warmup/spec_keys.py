"""Triton specialisation keys of real launches, without compiling or a GPU.

``recording()`` swaps every kernel of the series (kernel_warmup.SERIES_KERNELS,
plus the aliases other modules import) for a recorder: a launch
``kernel[grid](*args, **kwargs)`` or ``kernel.warmup(...)`` runs Triton 3.7.1's
own argument binder (``create_function_from_signature`` with the sm_86 CUDA
backend: the code JITFunction.run uses) and keeps the cache key it would look
up, ``compute_cache_key(specialization, options)``, then returns without
running anything. The launch functions around the kernels run for real (CPU
tensors), so the keys carry the real dtypes, alignments (data_ptr % 16), ints
equal to 1 and divisibility by 16.

``Recorder.sm86_configs()`` turns every recorded key back into a tests/sm86.py
compile job specialised exactly like that launch.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

_BACKEND = make_backend(GPUTarget("cuda", 86, 32))
_TYPE_OPTIONS = ("num_warps", "num_stages")


def _as_jit(kernel) -> JITFunction:
    if isinstance(kernel, JITFunction):
        return kernel
    # InterpretedFunction (TRITON_INTERPRET=1): same python function, same
    # do_not_specialize lists.
    kw = {k: v for k, v in getattr(kernel, "kwargs", {}).items()
          if k in ("do_not_specialize", "do_not_specialize_on_alignment")}
    return JITFunction(kernel.fn, **kw)


class Recorder:
    def __init__(self, name: str, kernel) -> None:
        self.name = name
        self.kernel = kernel
        self.jit = _as_jit(kernel)
        self.binder = create_function_from_signature(self.jit.signature, self.jit.params, _BACKEND)
        self.keys: dict[str, tuple] = {}
        self.launches = 0

    def _record(self, args, kwargs) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k != "grid"}
        _, spec, opts = self.binder(*args, **kwargs)
        self.keys.setdefault(compute_cache_key({}, spec, opts), (spec, dict(opts)))
        self.launches += 1

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._record(args, kwargs)

    def warmup(self, *args, grid=None, **kwargs):
        self._record(args, kwargs)

    def run(self, *args, grid=None, warmup=False, **kwargs):
        self._record(args, kwargs)

    def sm86_configs(self) -> list[dict]:
        """One tests/sm86.py job per recorded key, specialised as that launch:
        constexprs (ints equal to 1 included), 16-byte aligned / divisible
        args, pointer dtypes and int widths, num_warps / num_stages."""
        out = []
        names = [p.name for p in self.jit.params]
        for spec, opts in self.keys.values():
            sig, const, aligned = {}, {}, []
            for name, (ty, attr) in zip(names, spec):
                if ty == "constexpr":
                    const[name] = attr
                else:
                    sig[name] = ty
                    if attr == "D":
                        aligned.append(name)
            if opts.get("launch_pdl"):
                continue  # PDL: sm_90 only, never on a 3090
            out.append(dict(fn=self.kernel, signature=sig, constexprs=const, aligned=aligned,
                            num_warps=opts.get("num_warps", 4), num_stages=opts.get("num_stages", 3)))
        return out


def series_kernels():
    from vllm.models.qwen4_exp.nvidia import kernel_warmup as kw

    for patch, mod_name, name in kw.SERIES_KERNELS:
        mod = importlib.import_module(mod_name)
        yield patch, mod, name


@contextlib.contextmanager
def recording():
    """{kernel name: Recorder} for every series kernel while inside."""
    recs: dict[str, Recorder] = {}
    swapped = []
    by_id: dict[int, Recorder] = {}
    for _, mod, name in series_kernels():
        k = getattr(mod, name)
        rec = by_id.setdefault(id(k), Recorder(name, k))
        recs[name] = rec
    # every module attribute bound to one of these kernels (aliases such as
    # qsa_row_cache's `from .qsa import _qsa_merge_splitk_kernel`)
    for mod in list(sys.modules.values()):
        if mod is None or not getattr(mod, "__name__", "").startswith("vllm."):
            continue
        d = getattr(mod, "__dict__", {})
        for attr, val in list(d.items()):
            rec = by_id.get(id(val))
            if rec is not None:
                swapped.append((mod, attr, val))
                setattr(mod, attr, rec)
    try:
        yield recs
    finally:
        for mod, attr, val in swapped:
            setattr(mod, attr, val)


def keys_of(recs: dict[str, Recorder]) -> dict[str, set[str]]:
    return {n: set(r.keys) for n, r in recs.items()}


def missing(warm: dict[str, set[str]], replay: dict[str, set[str]]) -> dict[str, int]:
    """Replayed keys not in the warm set, counted per kernel."""
    return {n: len(k - warm.get(n, set())) for n, k in replay.items() if k - warm.get(n, set())}

"""Happens-before checker for a ViTBlockStreamer trace (shared by tests and
scripts/bench/vit_stream_overlap.py).

The trace is in issue order. CUDA semantics: ops on one stream run in order;
wait(stream, e) orders later ops on `stream` after the most recent record(e)
issued before the wait. A block j computing in slot s reads it from its
"compute" entry until the next record on the compute stream (after()).
"""

from __future__ import annotations


def check_trace(trace) -> list[str]:
    n = len(trace)
    succ: list[set[int]] = [set() for _ in range(n)]
    last_on: dict[str, int] = {}
    last_record: dict[int, int] = {}
    for k, e in enumerate(trace):
        if e.stream in last_on:
            succ[last_on[e.stream]].add(k)
        last_on[e.stream] = k
        if e.op == "record":
            last_record[e.event] = k
        elif e.op == "wait" and e.event in last_record:
            succ[last_record[e.event]].add(k)

    def hb(a: int, b: int) -> bool:  # a happens-before b
        seen, todo = {a}, [a]
        while todo:
            x = todo.pop()
            if x == b:
                return True
            for y in succ[x]:
                if y not in seen and y <= b:
                    seen.add(y)
                    todo.append(y)
        return False

    errors = []
    copies = [k for k, e in enumerate(trace) if e.op == "copy"]
    for k, e in enumerate(trace):
        if e.op != "compute":
            continue
        j, s = e.block, e.slot
        mine = [c for c in copies if c < k and trace[c].slot == s]
        if not mine or trace[mine[-1]].block != j:
            errors.append(f"block {j}: slot {s} was last filled with another block")
            continue
        if not hb(mine[-1], k):
            errors.append(f"block {j}: runs before its copy into slot {s} completed")
        end = next((r for r in range(k + 1, n) if trace[r].stream == e.stream
                    and trace[r].op == "record"), None)
        for c in copies:
            if c > k and trace[c].slot == s:
                if end is None or not hb(end, c):
                    errors.append(f"block {j}: slot {s} overwritten by block "
                                  f"{trace[c].block} while block {j} may run")
                break
    return errors

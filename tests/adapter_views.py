"""What the vLLM adapter's pure parts read, drawn without vLLM: stand-ins for vLLM's
requests and random views of its queues (tests/test_vllm_fit.py, test_adapter_decision.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from engine_adapter.vllm.fit import View
from scheduler_service.core import Request, Snapshot


@dataclass(eq=False)
class Req:
    """What the adapter reads of a vLLM request (compared by identity, as vLLM's are)."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int


@st.composite
def views(draw: st.DrawFn, max_waiting: int = 6, hits: bool = False) -> View:
    """Running decodes and prefills, then up to ``max_waiting`` waiting requests (some
    partly computed); with ``hits``, prefix-cache hits (some evictable) on some of the
    waiting requests with nothing computed."""
    reqs, rows, computed = [], [], []
    n_run = draw(st.integers(0, 6))
    for i in range(n_run + draw(st.integers(0, max_waiting))):
        prompt = draw(st.integers(1, 90))
        running = i < n_run
        if running and draw(st.booleans()):  # a decode
            out = draw(st.integers(1, 40))
            comp, snap_comp = prompt + out - 1, prompt
        else:
            out = 0
            comp = snap_comp = draw(st.integers(0, prompt - 1)) if (running or draw(st.booleans())) else 0
        rid = f"{'r' if running else 'w'}{i}"
        reqs.append(Request(rid, 0.0, prompt, computed_tokens=snap_comp, output_tokens=out, ttft_slo=1.0, tbt_slo=0.1))
        rows.append(Req(rid, comp, prompt + out))
        computed.append(comp)
    snap = Snapshot.from_requests(reqs, now=0.0, max_batch_tokens=4096, max_num_seqs=64)
    view = View(snap, rows, np.array(computed, np.int64), n_run, set())
    if hits and draw(st.booleans()):
        n = len(rows)
        view.hits, view.evictable = np.zeros(n, np.int64), np.zeros(n, np.int64)
        for i in range(n_run, n):
            if computed[i] == 0 and draw(st.booleans()):
                view.hits[i] = draw(st.integers(1, rows[i].num_tokens - 1)) if rows[i].num_tokens > 1 else 0
                view.evictable[i] = draw(st.integers(0, 3))
    return view

"""vLLM queues → :class:`~scheduler_service.core.Snapshot` (duck-typed; no vLLM import).

vLLM tracks a request as ``num_tokens`` known tokens (prompt + outputs) of
which ``num_computed_tokens`` are in the KV cache; with async scheduling the
in-flight step is already counted as computed and its sampled token is a
*placeholder* (``num_output_placeholders``).  The snapshot model (docs/usage.md,
Formats) has prompt/computed/output columns instead, so each request maps to:

* **decode** — it has (or is sampling) an output and needs exactly one more
  token: ``prompt = computed = P``, ``output = outputs + placeholders``;
* **prefill** — everything else needs ``known − computed`` tokens before it
  samples: ``prompt = known``, ``computed = num_computed_tokens``,
  ``output = 0``.  A preempted request (vLLM recomputes prompt *and* outputs)
  is therefore a prefill of all its known tokens; its TTFT deadline has long
  passed, so SLO-aware policies treat it as expired (served, not prioritised).

Requests vLLM would not schedule at all this step (async: the in-flight step
already reaches ``max_tokens``) are left out, so a plan cannot name them.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler_service.core import Snapshot

__all__ = ["RequestSlo", "SloDefaults", "SnapshotBuilder", "request_slo"]


@dataclass(frozen=True, slots=True)
class SloDefaults:
    #: TTFT for requests without one; 0 = ``ttft_base_s + ttft_per_token_s × prompt``.
    ttft_s: float = 0.0
    tbt_s: float = 0.05
    ttft_base_s: float = 0.3
    ttft_per_token_s: float = 0.00015


@dataclass(frozen=True, slots=True)
class RequestSlo:
    ttft_s: float
    tbt_s: float
    protected: bool


def _positive(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f > 0 and f == f and f != float("inf") else None


def request_slo(extra_args: Any, prompt_tokens: int, defaults: SloDefaults) -> RequestSlo:
    """SLOs from ``SamplingParams.extra_args`` (``slo_ttft_ms``, ``slo_tbt_ms``,
    ``slo_protected``; a nested ``{"slo": {"ttft_ms", "tbt_ms", "protected"}}`` works
    too), else the defaults.  Malformed values fall back to the defaults: a client
    must not be able to break the engine's scheduling with a bad field."""
    ttft = tbt = None
    protected: Any = False
    if isinstance(extra_args, dict) and extra_args:
        nested = extra_args.get("slo")
        src = nested if isinstance(nested, dict) else extra_args
        pre = "" if src is nested else "slo_"
        ttft = _positive(src.get(pre + "ttft_ms"))
        tbt = _positive(src.get(pre + "tbt_ms"))
        protected = src.get(pre + "protected", False)
    if ttft is None:
        ttft_s = defaults.ttft_s or defaults.ttft_base_s + defaults.ttft_per_token_s * prompt_tokens
    else:
        ttft_s = ttft / 1e3
    prot = protected in (True, 1, "1", "true", "True", "yes")
    return RequestSlo(ttft_s, (tbt / 1e3) if tbt is not None else defaults.tbt_s, prot)


_ids_of = operator.attrgetter("request_id")
#: what a running (or partly computed) request's row needs
_full = operator.attrgetter("num_output_placeholders", "num_computed_tokens", "num_prompt_tokens",
                            "num_tokens", "num_output_tokens", "max_tokens")
#: what a waiting request's row needs when nothing of it is computed (the bulk)
_computed_of = operator.attrgetter("num_computed_tokens")
_placeholders_of = operator.attrgetter("num_output_placeholders")
_num_tokens_of = operator.attrgetter("num_tokens")
_chain = itertools.chain.from_iterable


def _ro(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


class SnapshotBuilder:
    """Builds one snapshot per iteration, column-wise.

    The per-request constants (arrival, TTFT/TBT SLO, protected) live in a row
    pool filled once per request (SLOs are parsed once); each iteration reads the
    changing counters with C-level ``attrgetter`` maps and derives the token
    columns with numpy, so the Python work per request is a few attribute reads."""

    def __init__(self, defaults: SloDefaults, profile: str) -> None:
        self.defaults = defaults
        self.profile = profile
        self._slo: dict[str, RequestSlo] = {}
        self._slot: dict[str, int] = {}
        #: rows: arrival, ttft_s, tbt_s, protected (0/1)
        self._pool = np.zeros((1024, 4), np.float64)
        self.last_computed = np.zeros(0, np.int64)
        self.last_running_rows = 0

    def _slo_of(self, r: Any) -> RequestSlo:
        rid = r.request_id
        s = self._slo.get(rid)
        if s is None:
            sp = r.sampling_params
            s = request_slo(getattr(sp, "extra_args", None) if sp is not None else None,
                            r.num_prompt_tokens, self.defaults)
            self._slo[rid] = s
        return s

    def _add(self, r: Any) -> int:
        s = self._slo_of(r)
        row = (float(r.arrival_time), s.ttft_s, s.tbt_s, 1.0 if s.protected else 0.0)
        if not (math.isfinite(row[0]) and 0 < row[1] < math.inf and 0 < row[2] < math.inf):
            raise ValueError(f"request {r.request_id!r}: arrival/SLO not finite and positive: {row[:3]}")
        slot = len(self._slot)
        if slot >= len(self._pool):
            pool = np.zeros((2 * len(self._pool), 4), np.float64)
            pool[: len(self._pool)] = self._pool
            self._pool = pool
        self._pool[slot] = row
        self._slot[r.request_id] = slot
        return slot

    def prune(self, live: Any) -> None:
        """Forget finished requests (``live``: the scheduler's request map)."""
        if len(self._slo) > 2 * len(live) + 256:
            self._slo = {k: v for k, v in self._slo.items() if k in live}
        if len(self._slot) > 2 * len(live) + 256:
            keep = [(k, v) for k, v in self._slot.items() if k in live]
            rows = np.fromiter((v for _, v in keep), np.int64, len(keep))
            pool = np.zeros((max(1024, 2 * len(keep)), 4), np.float64)
            pool[: len(keep)] = self._pool[rows]
            self._pool = pool
            self._slot = {k: i for i, (k, _) in enumerate(keep)}

    def build(self, running: Iterable[Any], waiting: Iterable[Any], *, max_batch_tokens: int,
              max_num_seqs: int, free_kv_tokens: int | None,
              now: float | None = None, project: str = "") -> tuple[Snapshot, list[Any]]:
        """The snapshot and, aligned with its rows, the vLLM request objects.

        ``project``: called right after ``schedule()``, describe the queues as the
        *next* ``schedule()`` will find them.  ``"sync"``: every request whose known
        tokens are all computed samples one token in the step that is running, so it
        counts as an in-flight placeholder, as async scheduling books it.  ``"async"``
        (and ``"sync"``): a request whose in-flight tokens reach ``max_tokens`` drops
        out — vLLM skips it once the older in-flight step's output is applied (its
        own rule, evaluated now, keeps it while two steps are in flight)."""
        run = list(running)
        wait = list(waiting)
        nr, nw = len(run), len(wait)
        # running requests (and partly computed waiting ones): the general rule
        full = np.fromiter(_chain(map(_full, run)), np.int64, 6 * nr).reshape(nr, 6)
        if nw and (any(map(_computed_of, wait)) or any(map(_placeholders_of, wait))):
            # rare: the general rule for the waiting part too (it gives the
            # fresh rows below for requests with nothing computed)
            wf = np.fromiter(_chain(map(_full, wait)), np.int64, 6 * nw).reshape(nw, 6)
            full = np.concatenate([full, wf])
            wp = None
        else:  # not started: prompt = known tokens, nothing computed
            wp = np.fromiter(map(_num_tokens_of, wait), np.int64, nw)
        ph, comp, p, ntok, nout, mt = full.T
        if project == "sync":
            ph = ph + ((ph == 0) & (comp >= ntok))
        known = ntok + ph
        need = known - comp
        out = nout + ph
        done = comp + 2 - ph >= p + mt
        if project:
            done |= out >= mt
        keep = (need > 0) & ~((ph > 0) & done)
        dec = (out >= 1) & (need == 1)
        prompt = np.where(dec, p, known)
        computed = np.where(dec, p, comp)
        output = np.where(dec, out, 0)
        reqs = run + wait
        if wp is not None:
            prompt = np.concatenate([prompt, wp])
            computed = np.concatenate([computed, np.zeros(nw, np.int64)])
            output = np.concatenate([output, np.zeros(nw, np.int64)])
            keep = np.concatenate([keep, np.ones(nw, np.bool_)])
        comp_all = comp if wp is None else np.concatenate([comp, np.zeros(nw, np.int64)])
        if not keep.all():
            reqs = list(itertools.compress(reqs, keep.tolist()))
            prompt, computed, output = prompt[keep], computed[keep], output[keep]
            comp_all = comp_all[keep]
        #: vLLM's ``num_computed_tokens`` per row, and how many leading rows are running
        self.last_computed = comp_all
        self.last_running_rows = int(keep[:nr].sum())
        ids = list(map(_ids_of, reqs))
        slots = list(map(self._slot.get, ids))
        if None in slots:
            for i, sl in enumerate(slots):
                if sl is None:
                    slots[i] = self._add(reqs[i])
        # Every row is valid by construction (kept rows need tokens, so computed <
        # prompt or a decode with outputs; pool rows were checked once in _add):
        # the snapshot is built directly; only id uniqueness is checked per step.
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request ids in vLLM's queues")
        c = self._pool[np.array(slots, np.int64)].T.copy() if slots else np.zeros((4, 0), np.float64)
        snap = Snapshot(
            now=float(time.time() if now is None else now),
            max_batch_tokens=int(max_batch_tokens), max_num_seqs=int(max_num_seqs),
            ids=tuple(ids), arrival=_ro(c[0]), prompt_tokens=_ro(prompt), computed_tokens=_ro(computed),
            output_tokens=_ro(output), ttft_slo=_ro(c[1]), tbt_slo=_ro(c[2]), protected=_ro(c[3] != 0),
            free_kv_tokens=None if free_kv_tokens is None else int(free_kv_tokens), profile=self.profile,
        )
        return snap, reqs

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

A waiting request with nothing computed shows, as ``computed``, the prompt tokens vLLM's
prefix cache already holds for it (:class:`PrefixHits`, given by the scheduler), so that
the policy plans only the tokens beyond them, as vLLM will schedule it; the same count as
``cached``, so that the policy does not take it for a started request holding KV of its
own (``Snapshot.started``).
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler_service.core import Snapshot
from scheduler_service.core.columns import COLUMNS, COLUMNS_BY_NAME, COUNTER_COLUMNS
from scheduler_service.core.snapshot import MAX_BATCH_TOKENS

__all__ = ["ClassSlo", "PrefixHits", "RequestSlo", "SloDefaults", "SnapshotBuilder", "request_slo"]


@dataclass(frozen=True, slots=True)
class ClassSlo:
    """The objectives of one request priority (the adapter's class table): 0 = the
    engine-wide default for that objective."""

    ttft_s: float = 0.0
    tbt_s: float = 0.0
    sheddable: bool = False
    #: End-to-end objective (the last token within this many seconds of arrival); 0 = none.
    e2e_s: float = 0.0
    #: Objective on the mean time per output token; 0 = none (formula (1) judges).
    tpot_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SloDefaults:
    #: TTFT for requests without one; 0 = ``ttft_base_s + ttft_per_token_s × prompt``.
    ttft_s: float = 0.0
    tbt_s: float = 0.05
    ttft_base_s: float = 0.3
    ttft_per_token_s: float = 0.00015
    #: vLLM request priority → its class's objectives (requests of other priorities
    #: get the defaults above).
    classes: Mapping[int, ClassSlo] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestSlo:
    ttft_s: float
    tbt_s: float
    protected: bool
    priority: int = 0
    sheddable: bool = False
    e2e_s: float = 0.0
    tpot_s: float = 0.0


def _positive(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f > 0 and f == f and f != float("inf") else None


_TRUE = (True, 1, "1", "true", "True", "yes")
_TTFT, _TBT, _E2E, _TPOT, _PRIORITY = (COLUMNS_BY_NAME[k] for k in ("ttft_slo", "tbt_slo", "e2e_slo", "tpot_slo",
                                                                    "priority"))


def request_slo(extra_args: Any, prompt_tokens: int, defaults: SloDefaults, priority: int = 0) -> RequestSlo:
    """SLOs from ``SamplingParams.extra_args`` (``slo_ttft_ms``, ``slo_tbt_ms``,
    ``slo_protected``, ``slo_sheddable``, ``slo_e2e_ms``, ``slo_tpot_ms``; a nested
    ``{"slo": {"ttft_ms", "tbt_ms", "protected", "sheddable", "e2e_ms", "tpot_ms"}}`` works
    too), else the class table's entry for the request's vLLM ``priority``, else the
    defaults (no end-to-end or TPOT objective).  Malformed values fall back: a client must not be able to break the
    engine's scheduling with a bad field."""
    ttft = tbt = e2e = tpot = None
    protected: Any = False
    cls = defaults.classes.get(priority)
    sheddable: Any = cls.sheddable if cls is not None else False
    if isinstance(extra_args, dict) and extra_args:
        nested = extra_args.get("slo")
        src = nested if isinstance(nested, dict) else extra_args
        pre = "" if src is nested else "slo_"
        ttft = _positive(src.get(pre + "ttft_ms"))
        tbt = _positive(src.get(pre + "tbt_ms"))
        protected = src.get(pre + "protected", False)
        sheddable = src.get(pre + "sheddable", sheddable)
        e2e = _positive(src.get(pre + "e2e_ms"))
        tpot = _positive(src.get(pre + "tpot_ms"))
    if ttft is not None:
        ttft_s = ttft / 1e3
    elif cls is not None and cls.ttft_s > 0:
        ttft_s = cls.ttft_s
    else:
        ttft_s = defaults.ttft_s or defaults.ttft_base_s + defaults.ttft_per_token_s * prompt_tokens
    if tbt is not None:
        tbt_s = tbt / 1e3
    else:
        tbt_s = cls.tbt_s if cls is not None and cls.tbt_s > 0 else defaults.tbt_s
    e2e_s = e2e / 1e3 if e2e is not None else (cls.e2e_s if cls is not None else 0.0)
    tpot_s = tpot / 1e3 if tpot is not None else (cls.tpot_s if cls is not None else 0.0)
    # into the schema's bounds (a huge objective is no objective), so that one request's
    # values cannot fail the snapshot's validation
    return RequestSlo(_TTFT.clip(ttft_s), _TBT.clip(tbt_s), protected in _TRUE, int(priority),
                      sheddable in _TRUE, _E2E.clip(e2e_s), _TPOT.clip(tpot_s))


_ids_of = operator.attrgetter("request_id")
#: what a running (or partly computed) request's row needs
_full = operator.attrgetter("num_output_placeholders", "num_computed_tokens", "num_prompt_tokens",
                            "num_tokens", "num_output_tokens", "max_tokens")
#: what a waiting request's row needs when nothing of it is computed (the bulk)
_computed_of = operator.attrgetter("num_computed_tokens")
_placeholders_of = operator.attrgetter("num_output_placeholders")
_num_tokens_of = operator.attrgetter("num_tokens")
_chain = itertools.chain.from_iterable


#: The columns of the row pool: every column of the schema but the token counters (the
#: per-request constants), stored as float64 (exact for the int and bool columns' values).
_POOL = tuple(c for c in COLUMNS if c.name not in COUNTER_COLUMNS)
_POOL_COLUMNS = len(_POOL)
_TPOT_AT, _FIRST_AT = (next(k for k, c in enumerate(_POOL) if c.name == n) for n in ("tpot_slo", "first_token_time"))


def _row_values(r: Any, s: RequestSlo) -> dict[str, Any]:
    """A request's per-request constants by column name; a schema column not named here
    gets its default."""
    return {"arrival": float(r.arrival_time), "ttft_slo": s.ttft_s, "tbt_slo": s.tbt_s, "protected": s.protected,
            "priority": s.priority, "sheddable": s.sheddable, "e2e_slo": s.e2e_s, "tpot_slo": s.tpot_s}


def _priority(r: Any) -> int:
    """vLLM's ``Request.priority`` (an int; 0 when absent), clipped to the schema's bounds."""
    p = getattr(r, "priority", 0)
    return int(_PRIORITY.clip(int(p) if isinstance(p, int) else 0))


#: (hit tokens, hit blocks that are evictable, ``num_tokens`` looked up at) of a request
_NOT_LOOKED_UP = (0, 0, -1)


class PrefixHits:
    """The prefix-cache hits of waiting requests, for the snapshot: per request, the prompt
    tokens vLLM's prefix cache holds (``lookup(request)``: ``(hit tokens, evictable hit
    blocks)``, the scheduler's own lookup, docs/vllm.md, Prefix caching), remembered between
    snapshots so that a snapshot costs few lookups.

    Each :meth:`__call__` looks up every request not seen before (or whose tokens changed:
    preempted and back), at most ``new_per_build`` of them (the rest show 0 this time), and
    refreshes ``refresh_per_build`` others in turn (the cache changes under them: blocks
    cached by other requests, blocks evicted).  :meth:`forget` makes the next snapshot look a
    request up again (the scheduler calls it for the waiting requests a plan named: vLLM
    admitted them or refused them, in which case the hit it was planned with may be stale)."""

    def __init__(self, lookup: Callable[[Any], tuple[int, int]], *, new_per_build: int = 64,
                 refresh_per_build: int = 4) -> None:
        self.lookup = lookup
        self.new_per_build = new_per_build
        self.refresh_per_build = refresh_per_build
        self._memo: dict[str, tuple[int, int, int]] = {}
        self._turn = 0
        #: lookups done (a counter for tests and the benchmark)
        self.lookups = 0

    def forget(self, ids: Iterable[str]) -> None:
        pop = self._memo.pop
        for rid in ids:
            pop(rid, None)

    def prune(self, live: Any) -> None:
        """Forget finished requests (``live``: the scheduler's request map)."""
        if len(self._memo) > 2 * len(live) + 256:
            self._memo = {k: v for k, v in self._memo.items() if k in live}

    def __call__(self, reqs: list[Any], num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hit tokens and evictable hit blocks of ``reqs`` (waiting, nothing computed), whose
        ``num_tokens`` are given; each hit is below its request's ``num_tokens``."""
        n = len(reqs)
        if n == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        memo = self._memo
        known = np.fromiter(_chain(map(memo.get, map(_ids_of, reqs), itertools.repeat(_NOT_LOOKED_UP))),
                            np.int64, 3 * n).reshape(n, 3)
        hit, ev = known[:, 0].copy(), known[:, 1].copy()
        stale = known[:, 2] != num_tokens
        hit[stale] = 0
        ev[stale] = 0
        todo = np.flatnonzero(stale)[: self.new_per_build].tolist()
        fresh = np.flatnonzero(~stale)
        k = min(self.refresh_per_build, len(fresh))
        if k:
            start = self._turn % len(fresh)
            todo += np.take(fresh, np.arange(start, start + k), mode="wrap").tolist()
            self._turn = start + k
        lookup = self.lookup
        for i in todo:
            r = reqs[i]
            h, e = lookup(r)
            nt = int(num_tokens[i])
            h = max(0, min(int(h), nt - 1))
            memo[r.request_id] = (h, int(e), nt)
            hit[i], ev[i] = h, e
        self.lookups += len(todo)
        return hit, ev


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
        #: one row per request, one column per :data:`_POOL` column
        self._pool = np.zeros((1024, _POOL_COLUMNS), np.float64)
        self.last_computed = np.zeros(0, np.int64)
        self.last_running_rows = 0
        #: per row: prefix-cache hit tokens and evictable hit blocks (0 but for waiting rows)
        self.last_hits = np.zeros(0, np.int64)
        self.last_evictable = np.zeros(0, np.int64)
        #: some request had a TPOT objective: first tokens are timed (``first_token_time``)
        self._paced = False

    def _slo_of(self, r: Any) -> RequestSlo:
        rid = r.request_id
        s = self._slo.get(rid)
        if s is None:
            sp = r.sampling_params
            s = request_slo(getattr(sp, "extra_args", None) if sp is not None else None,
                            r.num_prompt_tokens, self.defaults, _priority(r))
            self._slo[rid] = s
            self._paced |= s.tpot_s > 0
        return s

    def _add(self, r: Any) -> int:
        values = _row_values(r, self._slo_of(r))
        row = [float(values.get(c.name, c.default)) for c in _POOL]  # checked with the snapshot
        slot = len(self._slot)
        if slot >= len(self._pool):
            pool = np.zeros((2 * len(self._pool), _POOL_COLUMNS), np.float64)
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
            pool = np.zeros((max(1024, 2 * len(keep)), _POOL_COLUMNS), np.float64)
            pool[: len(keep)] = self._pool[rows]
            self._pool = pool
            self._slot = {k: i for i, (k, _) in enumerate(keep)}

    def build(self, running: Iterable[Any], waiting: Iterable[Any], *, max_batch_tokens: int,
              max_num_seqs: int, free_kv_tokens: int | None,
              now: float | None = None, project: str = "",
              hits: PrefixHits | None = None) -> tuple[Snapshot, list[Any]]:
        """The snapshot and, aligned with its rows, the vLLM request objects.

        ``project``: called right after ``schedule()``, describe the queues as the
        *next* ``schedule()`` will find them.  ``"sync"``: every request whose known
        tokens are all computed samples one token in the step that is running, so it
        counts as an in-flight placeholder, as async scheduling books it.  ``"async"``
        (and ``"sync"``): a request whose in-flight tokens reach ``max_tokens`` drops
        out — vLLM skips it once the older in-flight step's output is applied (its
        own rule, evaluated now, keeps it while two steps are in flight).

        ``hits``: the waiting requests with nothing computed show their prefix-cache hits
        as computed tokens and as cached tokens (not started; :attr:`last_hits`,
        :attr:`last_evictable`)."""
        reqs, prompt, computed, output, comp_all, running_rows, hit, ev = _token_counts(
            list(running), list(waiting), project, hits)
        #: vLLM's ``num_computed_tokens`` per row, and how many leading rows are running
        self.last_computed = comp_all
        self.last_running_rows = running_rows
        self.last_hits, self.last_evictable = hit, ev
        ids = list(map(_ids_of, reqs))
        slots = list(map(self._slot.get, ids))
        if None in slots:
            for i, sl in enumerate(slots):
                if sl is None:
                    slots[i] = self._add(reqs[i])
        # The snapshot's columns are built typed and fresh, so the core's fast path checks
        # them (the schema's checks, a few reductions: every row should pass by
        # construction; one that does not raises ValidationError, a ValueError).
        now = float(time.time() if now is None else now)
        if self._paced and slots:
            self._time_first_tokens(np.array(slots, np.int64), output, now)
        c = self._pool[np.array(slots, np.int64)].T.copy() if slots else np.zeros((_POOL_COLUMNS, 0), np.float64)
        columns = {"prompt_tokens": prompt, "computed_tokens": computed, "output_tokens": output,
                   # the hits shown as computed: not started (Snapshot.started)
                   "cached_tokens": hit.copy()}  # (the snapshot's columns become read-only)
        for k, col in enumerate(_POOL):
            columns[col.name] = c[k] if col.dtype == np.float64 else (
                c[k] != 0 if col.dtype == np.bool_ else c[k].astype(col.dtype))
        snap = Snapshot.from_arrays(
            now=now,
            # the scheduler's largest budget (a larger one would only cost memory and time)
            max_batch_tokens=min(int(max_batch_tokens), MAX_BATCH_TOKENS), max_num_seqs=int(max_num_seqs),
            ids=tuple(ids), columns=columns,
            free_kv_tokens=None if free_kv_tokens is None else int(free_kv_tokens), profile=self.profile,
            max_requests=len(ids),  # the limit guards the service against clients, not the engine
        )
        return snap, reqs


    def _time_first_tokens(self, slots: np.ndarray, output: np.ndarray, now: float) -> None:
        """Record ``now`` as the first-token time of each request with a TPOT objective
        seen decoding for the first time (its first token came out in the step just
        ended, or, projected, comes out in the step running: a little early, so its pace
        is counted from no later than the truth)."""
        rows = self._pool[slots]
        new = (output > 0) & (rows[:, _TPOT_AT] > 0) & (rows[:, _FIRST_AT] == 0)
        if new.any():
            self._pool[slots[new], _FIRST_AT] = now


def _token_counts(run: list[Any], wait: list[Any], project: str, hits: PrefixHits | None = None) -> tuple[
        list[Any], np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
    """The requests a snapshot shows (``project``: see :meth:`SnapshotBuilder.build`) and
    their prompt, computed and output tokens as the core counts them, with vLLM's
    ``num_computed_tokens`` per row, how many leading rows are running, and the prefix-cache
    hit tokens and evictable hit blocks per row (``hits``; 0 but for waiting rows with
    nothing computed, which show the hit as computed)."""
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
    hit = np.zeros(len(reqs), np.int64)
    ev = np.zeros(len(reqs), np.int64)
    if hits is not None and nw:
        # waiting rows with nothing computed (vLLM looks their prefix up when it admits them)
        rows = nr + (np.arange(nw) if wp is not None else np.flatnonzero((comp[nr:] == 0) & (ph[nr:] == 0)))
        if len(rows):
            picked = wait if wp is not None else [reqs[i] for i in rows.tolist()]
            hit[rows], ev[rows] = hits(picked, prompt[rows])
            computed[rows] = hit[rows]  # a fresh array (np.where or concatenate)
    if not keep.all():
        reqs = list(itertools.compress(reqs, keep.tolist()))
        prompt, computed, output = prompt[keep], computed[keep], output[keep]
        comp_all, hit, ev = comp_all[keep], hit[keep], ev[keep]
    return reqs, prompt, computed, output, comp_all, int(keep[:nr].sum()), hit, ev

"""What the adapter does, visible from a running ``vllm serve``: logs and Prometheus metrics.

Logs: vLLM configures a handler for its own ``vllm`` logger only, so the
``engine_adapter`` logger's INFO lines would be dropped (and its warnings printed
bare by Python's last-resort handler).  :func:`attach_log_handler` gives the
``engine_adapter`` logger vLLM's own handlers (same stream, same format, with
the ``(EngineCore pid=…)`` prefix) when nobody configured logging for it.

Metrics: the scheduler runs in vLLM's EngineCore process, while vLLM's
``/metrics`` is served by the API server process from prometheus_client's
default registry there (vLLM uses prometheus_client's multiprocess mode only
with several API servers, and the engine core does not write to it), so the
adapter's counters cannot join vLLM's endpoint.  With ``SLIDINGSERVE_METRICS_PORT``
set, :class:`MetricsEndpoint` serves them from the engine-core process itself,
on its own port (plus the engine's data-parallel rank, so that several engine
cores of one server do not collide).  Values are read from
``slidingserve_stats()`` when scraped: nothing is added to the engine loop.
prometheus_client is imported only then (by :class:`MetricsEndpoint` and
:func:`collect_families`): an adapter without the endpoint does not load it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .settings import SettingsError, VllmAdapterSettings

__all__ = ["MetricsEndpoint", "attach_log_handler", "collect_families", "serve_metrics"]

_LOGGER = "engine_adapter"
_FALLBACK_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_FALLBACK_DATEFMT = "%m-%d %H:%M:%S"


def attach_log_handler(name: str = _LOGGER, *, fallback: bool = True) -> bool:
    """Give logger ``name`` vLLM's handlers when neither it nor the root logger has
    any; True when it attached handlers.

    When vLLM's logger has no handler (``VLLM_CONFIGURE_LOGGING=0``, or vLLM has not
    configured logging yet), ``fallback`` attaches one on stderr in vLLM's layout
    instead.  The level follows vLLM's logger (``VLLM_LOGGING_LEVEL``, INFO by default)
    unless the logger already has one.  Logging that someone configured (handlers on
    ``engine_adapter`` or on the root logger, e.g. through ``VLLM_LOGGING_CONFIG_PATH``)
    is left alone."""
    logger = logging.getLogger(name)
    if logger.handlers or logging.getLogger().handlers:
        return False
    vllm_logger = logging.getLogger("vllm")
    handlers: list[logging.Handler] = list(vllm_logger.handlers)
    if not handlers:
        if not fallback:
            return False
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setFormatter(logging.Formatter(_FALLBACK_FORMAT, _FALLBACK_DATEFMT))
        handlers = [stderr]
    for h in handlers:
        logger.addHandler(h)
    if logger.level == logging.NOTSET:
        level = vllm_logger.level if vllm_logger.level != logging.NOTSET else logging.INFO
        logger.setLevel(level)
    return True


def _fam(kind: str, name: str, doc: str, value: float | None = None,
         labels: list[str] | None = None, samples: list[tuple[list[str], float]] | None = None) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    if samples is None:
        return cls(name, doc, value=value)
    fam = cls(name, doc, labels=labels)
    for lv, v in samples:
        fam.add_metric(lv, v)
    return fam


def _decision_histogram(name: str, core: dict[str, Any]) -> Any:
    """How long the scheduler took to answer, as the engine saw it: remote, the whole round
    trip (a late answer at the deadline it missed); in process, the policy."""
    from prometheus_client.core import HistogramMetricFamily

    from engine_adapter.core import DECISION_BUCKETS

    counts = core.get("decision_counts") or [0] * (len(DECISION_BUCKETS) + 1)
    cum, buckets = 0, []
    for le, n in zip([*map(str, DECISION_BUCKETS), "+Inf"], counts, strict=True):
        cum += n
        buckets.append((le, cum))
    return HistogramMetricFamily(name, "Time the scheduler took to answer a decision, as the engine saw it (remote: "
                                 "the round trip, a late answer at its deadline; in process: the policy)",
                                 buckets=buckets, sum_value=core.get("decision_seconds", 0.0))


def collect_families(s: dict[str, Any], info: dict[str, str]) -> Iterator[Any]:
    """The metric families of one ``slidingserve_stats()`` dict (names as scraped
    get ``_total`` on counters); ``info``: labels of ``slidingserve_adapter_info``."""
    from prometheus_client.core import InfoMetricFamily  # only with the endpoint on (module doc)

    p = "slidingserve_adapter_"
    core = s.get("core_totals") or {}
    # an info family's samples get "_info": this one is scraped as slidingserve_adapter_info
    yield InfoMetricFamily(p.rstrip("_"), "The adapter's scheduler class, service, policy, engine profile, "
                           "vLLM version", value=info)
    yield _fam("counter", p + "iterations", "schedule() calls", s["iterations"])
    yield _fam("counter", p + "planned", "Iterations executed from the service's plan", s["planned"])
    yield _fam("counter", p + "native", "Iterations vLLM scheduled natively (fallbacks and idle steps)", s["native"])
    yield _fam("counter", p + "fallbacks", "Native iterations by reason (deadline, error, circuit_open, "
               "invalid_plan, kv_pressure, unallocatable, empty_plan, snapshot_error, unsupported)",
               labels=["reason"], samples=[([r], n) for r, n in sorted(s["fallbacks"].items())])
    yield _fam("counter", p + "remote_decisions", "Plans received from the scheduling service",
               core.get("remote_decisions", 0))
    yield _fam("counter", p + "deviating_iterations", "Planned iterations where vLLM scheduled other token counts "
               "than the plan", s["deviating_iterations"])
    yield _fam("counter", p + "deviated_requests", "Requests scheduled differently from the plan",
               s["deviated_requests"])
    yield _fam("counter", p + "trimmed_admissions", "Admissions dropped from plans by vLLM's admission rules",
               s["trimmed_admissions"])
    yield _fam("counter", p + "rejected_requests", "Sheddable requests finished early because a plan rejected "
               "them, by reason (ttft_expired, e2e_expired, ttft_unreachable, e2e_unreachable)", labels=["reason"],
               samples=[([r], n) for r, n in sorted(s.get("rejected", {}).items())])
    yield _fam("counter", p + "plan_preemptions", "Requests preempted (KV freed, recomputed later) because a "
               "plan listed them, to admit a higher class", s.get("plan_preemptions", 0))
    yield _fam("counter", p + "reports", "Iteration reports queued for ReportIterations", s["reports"])
    yield _fam("counter", p + "reports_sent", "Iteration reports delivered to the service",
               core.get("reports_sent", 0))
    yield _fam("counter", p + "reports_dropped", "Iteration reports dropped (backlog full while the service was away)",
               core.get("reports_dropped", 0))
    yield _fam("counter", p + "report_errors", "Report failures: collect (reading vLLM's output), send (the RPC)",
               labels=["stage"], samples=[(["collect"], s["report_errors"]),
                                          (["send"], core.get("report_errors", 0))])
    yield _fam("counter", p + "pipelined", "Plans decided in the background during the previous step",
               s["pipelined"])
    yield _fam("counter", p + "prefitted", "Background plans executed as fitted in the background (vLLM's "
               "KV state no tighter than projected)", s["prefitted"])
    yield _fam("counter", p + "resyncs", "Background plans taken again because the queues changed", s["resyncs"])
    yield _fam("counter", p + "own_seconds", "The adapter's own engine-thread time (schedule() and "
               "update_from_output() minus vLLM's work in them)", s["own_us"] / 1e6)
    yield _fam("gauge", p + "own_seconds_per_iteration", "Mean adapter engine-thread time per iteration since start",
               s["mean_own_us"] / 1e6)
    yield _decision_histogram(p + "decision_seconds", core)
    # named like vLLM's own vllm:num_requests_waiting_by_reason, next to which it is read
    yield _fam("gauge", "vllm:slidingserve_requests_waiting_by_reason", "Requests the latest explained plan "
               "does not fully serve, by SlidingServe reason code (docs/policies.md; one plan in explain_every)",
               labels=["reason"], samples=[([r], n) for r, n in (s.get("core") or {}).get("waiting_by_reason",
                                                                                        {}).items()])
    yield _fam("counter", p + "settings_reloads", "Settings file reloads by result", labels=["result"],
               samples=[(["success"], s["settings_reloads"]), (["failure"], s["settings_errors"])])


class _Collector:
    def __init__(self, stats: Callable[[], dict[str, Any]], info: Callable[[], dict[str, str]]) -> None:
        self._stats = stats
        self._info = info

    def describe(self) -> list[Any]:
        return []  # families are built on each scrape; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        yield from collect_families(self._stats(), self._info())


class MetricsEndpoint:
    """``/metrics`` of one scheduler on ``host:port``, in its own registry."""

    def __init__(self, stats: Callable[[], dict[str, Any]], info: Callable[[], dict[str, str]],
                 host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server  # the endpoint is on

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(stats, info))  # type: ignore[arg-type]
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(s: VllmAdapterSettings, rank: int, stats: Callable[[], dict[str, Any]],
                  info: Callable[[], dict[str, str]]) -> MetricsEndpoint:
    """The endpoint on ``metrics_port`` + the engine's data-parallel ``rank`` (several engine
    cores of one ``vllm serve`` each get their own port); :class:`SettingsError` when that
    port is taken."""
    port = s.metrics_port + rank
    try:
        return MetricsEndpoint(stats, info, s.metrics_host, port)
    except OSError as e:
        raise SettingsError(f"SLIDINGSERVE_METRICS_PORT: cannot listen on {s.metrics_host}:{port}: "
                            f"{e.strerror or e}") from None

"""A real vLLM OpenAI server scheduled by a real ``slidingserve serve``, driven by the ``openai`` client.

``make e2e`` runs it (``.venv-e2e``: the CPU build of vLLM).  Nothing is simulated: vLLM's
API server, engine core and CPU workers run the tiny Llama; the adapter
(``--scheduler-cls engine_adapter.vllm.RemoteSyncScheduler``) asks the service for every
iteration's batch over gRPC and reports measured iteration times; the checks read the
service's and the adapter's Prometheus endpoints, the service's predictor over gRPC
(``slidingserve predictor show --server``) and vLLM's output.

Token counts are exact: ``max_tokens`` with ``ignore_eos``, counted from the token ids vLLM
returns (``return_token_ids``) and from the usage it reports; the client never retries
(``max_retries=0``), so a lost request fails the test.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .command import DOC_EXAMPLE, DOC_EXAMPLE_TP2
from .conftest import BIN, Service, VllmServer, labels_of, total, vllm_server, wait_for

pytestmark = pytest.mark.timeout(1200)

REPO = Path(__file__).resolve().parents[2]
SUPPORTED_CPU_VERSION = "0.32.0"


@dataclass
class Outcome:
    max_tokens: int
    stream: bool
    token_ids: list[int]
    usage_tokens: int | None
    finish_reason: str | None
    stop_reason: Any = None


def _prompt(rng: random.Random, lo: int = 4, hi: int = 200) -> list[int]:
    return [rng.randrange(3, 1024) for _ in range(rng.randint(lo, hi))]


async def one(client: Any, model: str, prompt: list[int], max_tokens: int, *, stream: bool,
              slo: dict[str, float] | None = None) -> Outcome:
    extra: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}
    if slo:
        extra["vllm_xargs"] = slo  # per-request SLOs, read by the adapter from SamplingParams.extra_args
    if not stream:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, extra_body=extra)
        c = r.choices[0]
        return Outcome(max_tokens, False, list((c.model_extra or {}).get("token_ids") or []),
                       r.usage.completion_tokens if r.usage else None, c.finish_reason,
                       (c.model_extra or {}).get("stop_reason"))
    s = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, extra_body=extra,
                                        stream=True, stream_options={"include_usage": True})
    ids: list[int] = []
    usage = finish = stop = None
    async for ch in s:
        for c in ch.choices:
            ids += (c.model_extra or {}).get("token_ids") or []
            finish = c.finish_reason or finish
            stop = (c.model_extra or {}).get("stop_reason") or stop
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
    return Outcome(max_tokens, True, ids, usage, finish, stop)


def check_complete(outcomes: list[Outcome]) -> None:
    bad = [o for o in outcomes
           if not (len(o.token_ids) == o.max_tokens == o.usage_tokens and o.finish_reason == "length")]
    assert not bad, f"{len(bad)} of {len(outcomes)} requests incomplete, e.g. " + ", ".join(
        f"(stream={o.stream} wanted {o.max_tokens}, got {len(o.token_ids)} ids, usage {o.usage_tokens}, "
        f"finish {o.finish_reason})" for o in bad[:3])


def client_for(v: VllmServer) -> Any:
    import openai

    # No retries: a request the server loses must fail here, not be sent again.  One
    # connection per request: a kept-alive connection that vLLM's HTTP server closes after
    # 5 s idle (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) just as the pool hands it to a new request
    # fails that request with a ReadError before the server ever sees it (seen once in CI):
    # a client-side race, not a lost request, and not what these tests check.
    return openai.AsyncOpenAI(base_url=v.base_url, api_key="e2e", max_retries=0, timeout=600,
                              default_headers={"Connection": "close"})


async def burst(v: VllmServer, n_complete: int, n_stream: int, seed: int, max_tokens: tuple[int, int]) -> list[Outcome]:
    rng = random.Random(seed)
    async with client_for(v) as client:
        jobs = [one(client, v.cmd.model, _prompt(rng), rng.randint(*max_tokens), stream=k >= n_complete,
                    slo={"slo_ttft_ms": 2000, "slo_tbt_ms": 200} if k % 3 == 0 else None)
                for k in range(n_complete + n_stream)]
        return list(await asyncio.gather(*jobs))


def adapter(v: VllmServer) -> dict[str, Any]:
    """The adapter's counters, from its Prometheus endpoint in vLLM's engine-core process."""
    m = v.adapter_metrics()
    p = "slidingserve_adapter_"
    info = labels_of(m, p + "info")
    assert len(info) == 1, info
    fallbacks = {lab["reason"]: val for n, lab, val in m if n == p + "fallbacks_total"}
    return {
        "info": info[0],
        **{k: total(m, f"{p}{k}_total") for k in (
            "iterations", "planned", "native", "remote_decisions", "reports", "reports_sent", "reports_dropped",
            "deviating_iterations", "pipelined")},
        "report_errors_collect": total(m, p + "report_errors_total", stage="collect"),
        "report_errors_send": total(m, p + "report_errors_total", stage="send"),
        "fallbacks": fallbacks,
        "own_s_per_iter": total(m, p + "own_seconds_per_iteration"),
        "own_s": total(m, p + "own_seconds_total"),
    }


def predictor(service: Service, profile: str) -> dict[str, Any]:
    out = subprocess.run([str(BIN / "slidingserve"), "predictor", "show", "--server", service.address,
                          "--profile", profile], capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(out.stdout))


def test_docs_show_the_tested_command() -> None:
    """docs/vllm.md shows the command this test runs (same environment, entry point, arguments)."""
    doc = (REPO / "docs" / "vllm.md").read_text()
    for cmd in (DOC_EXAMPLE, DOC_EXAMPLE_TP2):
        assert cmd.shell() in doc, "docs/vllm.md's end-to-end section must show, verbatim:\n" + cmd.shell()


def _served_checks(v: VllmServer, service: Service, before: list[tuple[str, dict[str, str], float]],
                   outcomes: list[Outcome], tp: int) -> dict[str, Any]:
    check_complete(outcomes)
    a = adapter(v)
    info = a["info"]
    profile = info["profile"]
    assert profile.endswith(f"|tp{tp}") and profile.startswith("tiny-llama|"), info
    assert info["scheduler"] == v.cmd.scheduler_cls.rsplit(".", 1)[1] and info["address"] == service.address, info
    assert info["vllm_version"].split("+")[0] == SUPPORTED_CPU_VERSION and info["policy"] == "default", info
    assert info["engine_id"] == v.engine_id, info
    # the engine scheduled from the service's plans, executed them exactly, reported every step
    assert a["remote_decisions"] > 0 and a["planned"] > 0, a
    assert a["iterations"] >= a["planned"] + a["native"] - 1 and a["deviating_iterations"] == 0, a
    assert a["report_errors_collect"] == 0 and a["own_s"] > 0 and 0 < a["own_s_per_iter"] < 0.05, a

    # reports are best effort: a batch whose RPC misses its time-out on a loaded host is
    # dropped and counted, never retried; every queued report is either sent or counted
    def accounted() -> bool:
        b = adapter(v)
        return b["reports_sent"] + b["reports_dropped"] >= a["reports"] > 0

    wait_for("the adapter's reports sent or counted as dropped", accounted, 30)
    a = adapter(v)
    assert a["reports_sent"] > 0, a
    # the service saw this engine: decisions, accepted reports scored against this profile's
    # predictor, the engine in its engine table (log) and a refit of the profile's predictor
    after = service.metrics()
    decided = total(after, "slidingserve_decisions_total") - total(before, "slidingserve_decisions_total")
    assert decided >= a["remote_decisions"] * 0.5 > 0, (decided, a)
    scored = (total(after, "slidingserve_predictor_abs_error_ms_count", profile=profile)
              - total(before, "slidingserve_predictor_abs_error_ms_count", profile=profile))
    assert scored > 0, f"no reports scored for profile {profile}"
    assert f'"engine_id": "{v.engine_id}"' in service.logs()
    return {"adapter": a, "profile": profile, "decided": decided, "scored": scored}


def _refit_checks(service: Service, profile: str) -> dict[str, Any]:
    def refits() -> dict[str, float]:
        m = service.metrics()
        return {lab["outcome"]: val for n, lab, val in m
                if n == "slidingserve_predictor_refits_total" and lab.get("profile") == profile}

    # a refit fitted a candidate on this profile's reports and judged it on the newest ones:
    # published when it beat the current version, rejected when not (the bootstrap predictor
    # can be as good on a few hundred noisy CPU iterations); "skipped" means it had too few
    wait_for(f"a refit of {profile}'s predictor from the reports",
             lambda: sum(v for k, v in refits().items() if k != "skipped") > 0, 60)
    shown = predictor(service, profile)  # over gRPC, as an operator would look
    assert shown["profile_key"] == profile and shown["reports_accepted"] > 0 and shown["refits"] > 0, shown
    return {"refits": refits(), "predictor": {k: shown[k] for k in (
        "version", "profile_key", "reports_accepted", "refits", "published")}}


class TestTP1:
    """One engine, one worker (``--tensor-parallel-size 1``)."""

    def test_completions_and_streams(self, vllm_tp1: VllmServer, service: Service) -> None:
        v = vllm_tp1
        before = service.metrics()
        t0 = time.monotonic()
        outcomes = asyncio.run(burst(v, 24, 12, seed=1, max_tokens=(8, 96)))
        took = time.monotonic() - t0
        res = _served_checks(v, service, before, outcomes, tp=1)
        res.update(_refit_checks(service, res["profile"]))
        # the adapter's lines are in vLLM's output, in vLLM's format, from the engine core
        out = v.output()
        assert re.search(r"\(EngineCore pid=\d+\) INFO \S+ \S+ \[scheduler\.py:\d+\] slidingserve: scheduler "
                         + v.cmd.scheduler_cls.rsplit(".", 1)[1] + r" \(vLLM 0\.32\.0\), address="
                         + re.escape(service.address), out), \
            "the adapter's start-up line is not in vLLM's output"
        print(f"\nTP1: {len(outcomes)} requests in {took:.1f} s; {json.dumps(res, default=str)}")

    def test_rejected_requests_finish_with_a_clear_reason(self, vllm_tp1: VllmServer, service: Service) -> None:
        """Sheddable requests whose TTFT has passed by the time the engine sees them are rejected
        by SlidingServe and answered at once: a completion with finish reason ``abort`` and stop
        reason ``slidingserve:ttft_expired``; a stream closes with no token (vLLM's API sends no
        final chunk for a request that ends before its first token, see docs/vllm.md).  The same
        requests not sheddable are served in full; the adapter counts the rejections.

        An iteration the service misses (deadline, circuit open) is scheduled natively, which
        does not shed; a round with a fallback only has to serve everything it did not reject,
        and is tried again (a busy machine) until one rejects all four."""
        v = vllm_tp1
        late = {"slo_ttft_ms": 0.001, "slo_tbt_ms": 200}

        async def run(seed: int) -> list[Outcome]:
            rng = random.Random(seed)
            async with client_for(v) as client:
                return list(await asyncio.gather(*(
                    one(client, v.cmd.model, _prompt(rng, 64, 200), 16, stream=k % 2 == 1,
                        slo={**late, "slo_sheddable": k < 4})
                    for k in range(8))))

        def rejected_count() -> float:
            return total(v.adapter_metrics(), "slidingserve_adapter_rejected_requests_total", reason="ttft_expired")

        rounds = []
        for attempt in range(5):
            r0, f0 = rejected_count(), sum(adapter(v)["fallbacks"].values())
            out = asyncio.run(run(attempt))
            r1, f1 = rejected_count(), sum(adapter(v)["fallbacks"].values())
            rejected = [o for o in out[:4] if o.token_ids == [] and o.finish_reason != "length"]
            for o in rejected:
                want = (None, 0) if o.stream else ("abort", "slidingserve:ttft_expired")
                assert ((o.finish_reason, o.usage_tokens) if o.stream else (o.finish_reason, o.stop_reason)) == want, o
            check_complete([o for o in out if o not in rejected])
            assert r1 - r0 == len(rejected), (r1 - r0, rejected)
            rounds.append((len(rejected), f1 - f0))
            if f1 == f0:  # no fallback in this round: every sheddable request was rejected
                assert len(rejected) == 4, (out, rounds)
            if len(rejected) == 4:
                break
        else:
            pytest.fail(f"no round rejected all 4 (rejected, fallbacks): {rounds}")
        print(f"\nrejections: rounds (rejected of 4, fallbacks) {rounds}")

    def test_faults_while_streaming(self, vllm_tp1: VllmServer, service: Service) -> None:
        """The service SIGKILLed mid-run and restarted, then its policy config's default deployment
        swapped, all while requests stream: none is lost, each completes in full, the engine
        serves natively while the service is away and schedules remotely again by itself."""
        v = vllm_tp1
        marks: dict[str, Any] = {}
        # the service is shared by the session: an earlier run of this test left v2 the default
        service.write_policies("v1")

        async def run() -> list[Outcome]:
            rng = random.Random(7)
            tasks: list[asyncio.Task[Outcome]] = []
            stop = asyncio.Event()
            async with client_for(v) as client:
                def launch(stream: bool, lo: int, hi: int) -> None:
                    tasks.append(asyncio.ensure_future(one(
                        client, v.cmd.model, _prompt(rng, 4, 64), rng.randint(lo, hi), stream=stream)))

                async def arrivals() -> None:
                    """Requests arrive all the time: short and long, streamed and not."""
                    k = 0
                    while not stop.is_set():
                        launch(rng.random() < 0.5, 16, 160)
                        if k % 8 == 0:
                            launch(True, 300, 440)  # long streams that span a fault
                        k += 1
                        await asyncio.sleep(0.15)

                def in_flight() -> int:
                    return sum(not t.done() for t in tasks)

                async def until(what: str, ok: Any, timeout_s: float) -> None:
                    end = time.monotonic() + timeout_s
                    while not ok():
                        if time.monotonic() > end:
                            raise AssertionError(f"{what}: not within {timeout_s:g} s; adapter: {adapter(v)}")
                        await asyncio.sleep(0.25)

                gen = asyncio.ensure_future(arrivals())
                await until("remote plans before the kill", lambda: adapter(v)["remote_decisions"] > 0, 60)
                await asyncio.sleep(2.0)

                # 1. kill the service (no drain)
                # each fault waits for a request in flight: with short requests the stream can
                # be empty for an instant (it once was at the restart)
                await until("a request in flight before the kill", lambda: in_flight() > 0, 30)
                a0 = adapter(v)
                marks["in_flight_at_kill"] = in_flight()
                service.kill()
                done0 = sum(t.done() for t in tasks)

                def outage_seen() -> bool:
                    f = adapter(v)["fallbacks"]
                    return sum(f.get(r, 0) - a0["fallbacks"].get(r, 0) for r in ("error", "deadline",
                                                                                  "circuit_open")) > 5
                await until("native fallbacks after the kill", outage_seen, 60)
                await asyncio.sleep(3.0)
                marks["down"] = adapter(v)
                marks["completed_while_down"] = sum(t.done() for t in tasks) - done0

                # 2. restart it on the same port: the adapter finds it by itself
                await until("a request in flight before the restart", lambda: in_flight() > 0, 30)
                marks["in_flight_at_restart"] = in_flight()
                service.start()
                r0 = marks["down"]["remote_decisions"]
                await until("remote plans again after the restart", lambda: adapter(v)["remote_decisions"] > r0 + 20,
                            90)
                await until("the restarted service deciding", lambda: total(
                    service.metrics(), "slidingserve_deployment_decisions_total", deployment="v1") > 0, 30)

                # 3. swap the default deployment while requests stream
                await until("a request in flight before the swap", lambda: in_flight() > 0, 30)
                marks["in_flight_at_swap"] = in_flight()
                service.write_policies("v2")
                await until("decisions by v2 after the swap", lambda: total(
                    service.metrics(), "slidingserve_deployment_decisions_total", deployment="v2") > 20, 60)
                await asyncio.sleep(2.0)
                marks["after_swap"] = adapter(v)
                # stop the arrivals; every request must come back
                stop.set()
                await gen
                return list(await asyncio.gather(*tasks))

        outcomes = asyncio.run(run())
        check_complete(outcomes)
        for k in ("in_flight_at_kill", "in_flight_at_restart", "in_flight_at_swap"):
            assert marks[k] > 0, marks
        down, end = marks["down"], adapter(v)
        assert marks["completed_while_down"] > 0, marks  # the engine kept serving without the service
        # nothing remote while the service was down, natively scheduled meanwhile; remote again after
        assert end["remote_decisions"] > down["remote_decisions"] and end["planned"] > down["planned"]
        assert end["native"] > 0 and set(down["fallbacks"]) & {"error", "deadline", "circuit_open"}, down
        m = service.metrics()  # the restarted process's counters: all from after the restart
        wait_for("reports delivered again after the restart", lambda: adapter(v)["reports_sent"]
                 > down["reports_sent"], 30)
        assert total(m, "slidingserve_reports_total", result="accepted") > 0
        assert total(m, "slidingserve_policy_config_reloads_total", result="success") >= 1
        assert total(m, "slidingserve_deployment_decisions_total", deployment="v2") > 0
        # the adapter's fallback warnings reach vLLM's output too
        assert re.search(r"\(EngineCore pid=\d+\) WARNING \S+ \S+ \[stats\.py:\d+\] slidingserve: native "
                         r"scheduling \((error|deadline|circuit_open)", v.output()), \
            "the adapter's fallback warning is not in vLLM's output"
        print(f"\nfaults: {len(outcomes)} requests, all complete; in flight at kill/restart/swap: "
              f"{marks['in_flight_at_kill']}/{marks['in_flight_at_restart']}/{marks['in_flight_at_swap']}; "
              f"completed while the service was down: {marks['completed_while_down']}; adapter at the end: {end}")


class TestTP1Async(TestTP1):
    """The same tests with vLLM's ``--async-scheduling`` and ``RemoteScheduler``: the mode
    and class GPUs run (step k + 1 scheduled before step k's output is applied)."""

    @pytest.fixture(scope="class")
    @classmethod
    def vllm_tp1(cls, root: Path, model: str, service: Service) -> Iterator[VllmServer]:
        yield from vllm_server(root, model, service, 1, async_scheduling=True)

    def test_vllm_runs_with_async_scheduling(self, vllm_tp1: VllmServer) -> None:
        assert "'async_scheduling': True" in vllm_tp1.output()  # vLLM's own record of its arguments
        assert adapter(vllm_tp1)["info"]["scheduler"] == "RemoteScheduler"


class TestTP2:
    """Two CPU workers (``--tensor-parallel-size 2``, one core each): the engine core schedules,
    the workers run the model as separate processes, one adapter per engine."""

    def test_completions_and_streams(self, vllm_tp2: VllmServer, service: Service) -> None:
        v = vllm_tp2
        before = service.metrics()
        t0 = time.monotonic()
        outcomes = asyncio.run(burst(v, 12, 6, seed=2, max_tokens=(8, 64)))
        took = time.monotonic() - t0
        res = _served_checks(v, service, before, outcomes, tp=2)
        assert "world_size=2" in v.output()
        print(f"\nTP2: {len(outcomes)} requests in {took:.1f} s; {json.dumps(res, default=str)}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

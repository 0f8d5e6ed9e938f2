"""The live benchmark's measuring and bookkeeping (clients/live), without an engine: the two
SLO definitions, goodput over a sweep, the requests of a run, configurations, the report.
The benchmark itself runs against a real ``vllm serve`` in tests/e2e/test_live_bench.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from clients.live.command import main, parser, spec_of
from clients.live.measure import RequestResult, Slo, goodput, summarize
from clients.live.report import (
    aa_band,
    aa_table,
    capacity_note,
    goodputs,
    judge_table,
    markdown,
    noise_table,
    shared_note,
    sim_table,
    timing_table,
    verdicts,
    write_plot,
)
from clients.live.runner import (
    CAPACITY_BAR,
    Config,
    LiveSpec,
    _spec_dict,
    check_resumable,
    find_capacity,
    foreign_share,
    resolve_rates,
)
from clients.live.workload import WorkloadSpec, make_requests
from engine_adapter.vllm.settings import VllmAdapterSettings

SLO = Slo(ttft_ms=1000, tbt_ms=50)


def _req(ttft: float, gaps: list[float], n: int | None = None) -> RequestResult:
    times = list(np.cumsum([ttft, *gaps]))
    return RequestResult(0, 0.0, n if n is not None else len(times), [float(t) for t in times])


def test_formula1_allows_slack_the_tpot_definition_does_not() -> None:
    # first token at 0.1 s leaves 0.9 s of slack: 20 tokens 90 ms apart are all on time
    # under formula (1) (token k due at 1 + 0.05 k), but their mean TPOT is 90 ms > 50
    r = _req(0.1, [0.09] * 19)
    assert r.ok_formula1(SLO) and not r.ok_tpot(SLO)


def test_tpot_definition_forgives_one_long_gap_formula1_does_not() -> None:
    # first token at 0.95 s, then a 0.2 s stall and four 10 ms tokens: token 1 arrives at
    # 1.15 s, due at 1.05 s under formula (1); the mean time per output token is 48 ms
    r = _req(0.95, [0.2] + [0.01] * 4)
    assert r.tpot_s == pytest.approx(0.24 / 5)
    assert r.ok_tpot(SLO) and not r.ok_formula1(SLO)
    assert _req(0.95, [0.05] * 5).ok_formula1(SLO)  # every token exactly on time counts


def test_incomplete_or_failed_requests_miss_both() -> None:
    short = _req(0.1, [0.01] * 3, n=10)
    failed = RequestResult(1, 0.0, 4, [], error="ReadError: boom")
    for r in (short, failed):
        assert not r.ok_formula1(SLO) and not r.ok_tpot(SLO)
    s = summarize([short, failed, _req(0.1, [0.01] * 3)], SLO)
    assert (s.requests, s.completed, s.errors) == (3, 1, 1)
    assert s.attain_f1 == s.attain_tpot == pytest.approx(1 / 3)
    assert s.first_error == "ReadError: boom"


def test_summary_percentiles_and_max() -> None:
    rs = [RequestResult(i, 0.0, 3, [0.1 * (i + 1), 0.1 * (i + 1) + 0.02, 0.1 * (i + 1) + 0.04]) for i in range(10)]
    s = summarize(rs, SLO)
    assert s.ttft_max_ms == pytest.approx(1000.0)
    assert s.ttft_p50_ms == pytest.approx(550.0)
    assert s.tpot_p50_ms == pytest.approx(20.0)
    assert s.attain_f1 == 1.0


def test_goodput_interpolates_at_the_crossing() -> None:
    assert goodput([1, 2, 3], [1.0, 0.95, 0.85], 0.9) == pytest.approx(2.5)
    assert goodput([3, 1, 2], [0.85, 1.0, 0.95], 0.9) == pytest.approx(2.5)  # order does not matter
    assert goodput([1, 2], [0.5, 0.4], 0.9) == 0.0
    assert goodput([1, 2], [0.99, 0.95], 0.9) == 2.0
    # a later recovery above the threshold does not count: the first crossing decides
    assert goodput([1, 2, 3], [0.95, 0.8, 0.95], 0.9) == pytest.approx(1 + 0.05 / 0.15)
    with pytest.raises(ValueError):
        goodput([1, 2], [0.9], 0.9)


@given(st.lists(st.floats(0, 1), min_size=1, max_size=6), st.floats(0.05, 1.0))
def test_goodput_is_a_rate_where_the_sweep_met_the_threshold(att: list[float], thr: float) -> None:
    rates = [float(i + 1) for i in range(len(att))]
    g = goodput(rates, att, thr)
    assert g == 0.0 or rates[0] <= g <= rates[-1]
    if g > 0:
        below = [r for r, a in zip(rates, att, strict=True) if r <= g]
        assert all(a >= thr for r, a in zip(rates, att, strict=True) if r in below)


def test_requests_repeat_per_seed_and_respect_the_engine() -> None:
    spec = WorkloadSpec(requests=50, warmup=10, max_prompt=300, max_output=20)
    a, b = make_requests(spec, 4.0, 3), make_requests(spec, 4.0, 3)
    assert a == b
    assert make_requests(spec, 4.0, 4) != a
    assert len(a) == 60 and sum(r.warmup for r in a) == 10 and a[0].warmup and not a[-1].warmup
    assert all(1 <= len(r.prompt) <= 300 and 2 <= r.output_len <= 20 for r in a)
    assert all(3 <= t < spec.vocab_size for r in a for t in r.prompt)
    at = [r.at_s for r in a]
    assert at[0] == 0.0 and at == sorted(at)
    # the same lengths at another rate; arrivals scale
    c = make_requests(spec, 8.0, 3)
    assert [len(r.prompt) for r in c] == [len(r.prompt) for r in a]
    assert c[-1].at_s == pytest.approx(a[-1].at_s / 2)
    long = make_requests(WorkloadSpec(requests=400, warmup=0), 5.0, 1)
    assert np.mean(np.diff([r.at_s for r in long])) == pytest.approx(0.2, rel=0.15)
    with pytest.raises(ValueError):
        make_requests(spec, 0.0, 1)


def test_shared_prefix_puts_one_system_prompt_before_the_same_requests() -> None:
    spec = WorkloadSpec(requests=30, warmup=5, max_prompt=300, max_output=20)
    with_prefix = WorkloadSpec(requests=30, warmup=5, max_prompt=300, max_output=20, shared_prefix=64)
    plain, shared = make_requests(spec, 4.0, 3), make_requests(with_prefix, 4.0, 3)
    prefix = shared[0].prompt[:64]
    assert len(prefix) == 64 and all(3 <= t < spec.vocab_size for t in prefix)
    # the same requests (lengths, outputs, arrivals) with the prefix before each prompt
    for a, b in zip(plain, shared, strict=True):
        assert b.prompt == prefix + a.prompt
        assert (b.at_s, b.output_len, b.warmup) == (a.at_s, a.output_len, a.warmup)
    assert make_requests(with_prefix, 2.0, 9)[0].prompt[:64] == prefix  # one system prompt for every run
    with pytest.raises(ValueError, match="shared_prefix must be >= 0"):
        WorkloadSpec(shared_prefix=-1)
    # the command line: --shared-prefix, within the engine's tokens per request
    assert spec_of(parser().parse_args(["--shared-prefix", "512", "--prefix-caching"])).workload.shared_prefix == 512
    assert spec_of(parser().parse_args([])).workload.shared_prefix == 0
    with pytest.raises(ValueError, match="over the engine's 2048"):
        spec_of(parser().parse_args(["--shared-prefix", "1000"]))


def test_multi_turn_chats_send_each_turn_after_the_one_before() -> None:
    """``turns`` > 1: request c*turns+k is turn k of conversation c; a later turn names the
    request before it, carries only its new user message (the client puts the history first)
    and a think time; the lengths and tokens are those of the single-turn requests."""
    one = WorkloadSpec(requests=60, warmup=6, max_prompt=200, max_output=20, shared_prefix=32)
    chat = WorkloadSpec(requests=60, warmup=6, max_prompt=200, max_output=20, shared_prefix=32, turns=3, think_s=0.5)
    plain, turns = make_requests(one, 3.0, 5), make_requests(chat, 3.0, 5)
    assert turns == make_requests(chat, 3.0, 5) and turns != make_requests(chat, 3.0, 6)
    assert [r.index for r in turns] == list(range(66)) and sum(r.warmup for r in turns) == 6
    for i, (a, b) in enumerate(zip(plain, turns, strict=True)):
        first = i % 3 == 0
        assert b.prev == (-1 if first else i - 1) and (b.think_s == 0.0) == first
        assert b.prompt == (a.prompt if first else a.prompt[32:]) and b.output_len == a.output_len
        assert b.at_s == turns[i - i % 3].at_s  # a later turn: its conversation's start
    starts = [r.at_s for r in turns[::3]]
    assert starts[0] == 0.0 and starts == sorted(starts)
    long = make_requests(WorkloadSpec(requests=900, warmup=0, turns=3, think_s=2.0), 3.0, 1)
    assert np.mean(np.diff([r.at_s for r in long[::3]])) == pytest.approx(1.0, rel=0.15)  # rate / turns
    assert np.mean([r.think_s for r in long if r.prev >= 0]) == pytest.approx(2.0, rel=0.15)
    assert chat.longest_request() == 32 + 3 * 220
    with pytest.raises(ValueError, match="turns must be >= 1"):
        WorkloadSpec(turns=0)
    # the command line: --turns and --think-s, the whole history within the engine's context
    args = ["--turns", "3", "--max-prompt", "400", "--max-output", "64", "--think-s", "0.5"]
    spec = spec_of(parser().parse_args(args))
    assert (spec.workload.turns, spec.workload.think_s, spec.judge_seeds) == (3, 0.5, ())
    with pytest.raises(ValueError, match="may hold 3456 tokens"):
        spec_of(parser().parse_args(["--turns", "3"]))
    with pytest.raises(ValueError, match="--judge-seeds 0"):
        spec_of(parser().parse_args([*args, "--judge-seeds", "1"]))
    with pytest.raises(ValueError, match="not with --turns"):
        spec_of(parser().parse_args([*args, "--sim"]))


def test_config_parse() -> None:
    assert Config.parse("vllm").mode == "native"
    c = Config.parse("remote:slidingserve:decode_skip_tbts=0,skip_late_decodes=false")
    assert (c.mode, c.policy, dict(c.params)) == ("remote", "slidingserve",
                                                   {"decode_skip_tbts": "0", "skip_late_decodes": "false"})
    assert c.settings("h:1", SLO)["address"] == "h:1"
    assert Config.parse("inproc:qoserve").settings("h:1", SLO)["address"] == "inproc"
    for bad in ("gpu:slidingserve", "inproc", "inproc:nope", "inproc:slidingserve:window", "inproc:slidingserve:window=9"):
        with pytest.raises(ValueError):
            Config.parse(bad)
    # the objective is the requests', not a policy parameter
    t = Config.parse("inproc:slidingserve:objective=tpot,window=3")
    assert (t.objective, dict(t.params)) == ("tpot", {"window": "3"}) and t.label.endswith("objective=tpot,window=3")
    assert t.xargs(SLO) == {"slo_tpot_ms": SLO.tbt_ms} and c.xargs(SLO) is None and c.objective == "formula1"
    with pytest.raises(ValueError, match="objective must be one of formula1, tpot, got 'p99'"):
        Config.parse("inproc:slidingserve:objective=p99")
    # so is the engine's wait bound, which reaches the engine's settings file
    b = Config.parse("inproc:slidingserve:shed_after=4,window=3")
    assert (b.shed_after, dict(b.params), b.settings("h:1", SLO)["shed_after"]) == (4.0, {"window": "3"}, 4.0)
    assert VllmAdapterSettings(**b.settings("h:1", SLO)).shed_after == 4.0
    assert c.shed_after == 0.0
    for bad in ("-1", "x", "nan"):
        with pytest.raises(ValueError, match="shed_after must be a number from 0 to 1000"):
            Config.parse(f"inproc:slidingserve:shed_after={bad}")


def test_runs_interleave_configurations_seed_by_seed() -> None:
    cs = tuple(Config.parse(x) for x in ("vllm", "inproc:slidingserve", "remote:slidingserve"))
    order = LiveSpec(cs, rates=(1.0, 2.0), seeds=(1, 2, 3)).order()
    assert len(order) == 18 and len(set((r, s, c.label) for r, s, c in order)) == 18
    firsts = [order[i][2].label for i in range(0, 9, 3)]
    assert firsts == ["vllm", "inproc:slidingserve", "remote:slidingserve"]


def _run(config: str, rate: float, seed: int, f1: float, tp: float) -> dict[str, object]:
    return {"config": config, "mode": "native" if config == "vllm" else "inproc", "rate": rate, "seed": seed,
            "attain_f1": f1, "attain_tpot": tp, "ttft_p99_ms": 900.0, "ttft_max_ms": 1500.0 + seed,
            "tpot_p50_ms": 20.0, "tpot_p99_ms": 40.0}


def test_report_goodput_and_ratio_seed_by_seed() -> None:
    runs = [_run("vllm", 1, 1, 1.0, 1.0), _run("vllm", 2, 1, 0.8, 0.8),
            _run("inproc:slidingserve", 1, 1, 1.0, 1.0), _run("inproc:slidingserve", 2, 1, 0.9, 0.7)]
    g = goodputs(runs, "attain_f1", 0.9)
    assert g["vllm"][1] == pytest.approx(1.5) and g["inproc:slidingserve"][1] == 2.0
    text = markdown(runs, 0.9)
    assert "| inproc:slidingserve | 2.00 (2.00–2.00) | 1.33× (1.33–1.33) |" in text
    assert "1.50" in text and not math.isnan(g["vllm"][1])


def test_fitted_truth_follows_its_predictor_with_mean_one_noise() -> None:
    from clients.live.sim import FittedTruth, cost_structure
    from scheduler_service.core import default_predictor

    pred = default_predictor()
    truth = FittedTruth(pred, noise_sigma=0.2)
    c, u = np.array([1, 1, 300, 0]), np.array([100, 50, 0, 999])
    exact = float(pred.predict_batch_ms(c[:3], u[:3]))
    assert truth.iteration_ms(c, u) == pytest.approx(exact)  # pieces with no token are not in the batch
    assert truth.iteration_ms(np.array([0]), np.array([5])) == 0.0
    rng = np.random.default_rng(0)
    noisy = [truth.iteration_ms(c, u, rng) for _ in range(4000)]
    assert np.mean(noisy) == pytest.approx(exact, rel=0.02) and np.std(noisy) > 0.1 * exact
    cost = cost_structure(pred)
    assert cost["per_decode_ms"] > 0 and cost["per_prefill_token_ms"] > 0 and cost["prefill_512_ms"] > cost["one_decode_ms"]


def test_simulated_replay_has_the_live_records_shape() -> None:
    from clients.live.sim import simulate_sweep
    from scheduler_service.core import default_predictor

    spec = LiveSpec(tuple(Config.parse(x) for x in ("vllm", "inproc:slidingserve")), rates=(2.0,), seeds=(1,),
                    workload=WorkloadSpec(requests=30, warmup=5))
    sim = simulate_sweep(spec, default_predictor(), 0.1)
    assert [r["config"] for r in sim] == ["vllm", "inproc:slidingserve"]
    assert [r["policy"] for r in sim] == ["vllm-fcfs", "slidingserve"]
    for r in sim:
        assert r["requests"] == r["completed"] == 30 and 0 <= r["attain_tpot"] <= 1 and 0 <= r["attain_f1"] <= 1
        assert r["ttft_max_ms"] >= r["ttft_p50_ms"] > 0
    text = sim_table([{**r, "source": "live"} for r in sim], sim)
    rows = [x for x in text.splitlines() if x.startswith("| vllm |") or x.startswith("| inproc")]
    assert len(rows) == 2 and not any("⚠" in x for x in rows)  # the same records: no gap
    off = [{**r, "attain_tpot": r["attain_tpot"] - 0.2} for r in sim]
    assert "⚠" in next(x for x in sim_table(off, sim).splitlines() if x.startswith("| inproc"))
    assert "lognormal σ 0.1." in sim_table(off, sim)



def test_judge_table_sets_the_two_measurements_side_by_side() -> None:
    run = {**_run("vllm", 2, 1, 1.0, 1.0), "good_rps_tpot": 1.9,
           "judge": {"goodput": 1.8, "ttft_max_ms": 1400.0, "tpot_p50_ms": 21.0}}
    assert "| vllm | 2 | 1 | 1.90 / 1.80 | 1.50 / 1.40 | 20.0 / 21.0 |" in judge_table([run])
    assert judge_table([_run("vllm", 2, 1, 1.0, 1.0)]) == ""


def test_noise_table_reports_margin_overruns_and_refits() -> None:
    def remote(seed: int, none: float, learned: float, margin: float, refits: dict[str, float]) -> dict[str, Any]:
        return {**_run("remote:slidingserve", 2, seed, 1.0, 1.0), "mode": "remote", "service_mae_ms": 2.0 + seed,
                "overrun_share": {"none": none, "learned": learned}, "service_margin": margin,
                "service_refits_run": refits}

    runs = [_run("vllm", 2, 1, 1.0, 1.0), remote(1, 0.5, 0.1, 1.2, {"published": 1.0}),
            remote(2, 0.4, 0.06, 1.25, {"rejected": 2.0, "remargined": 1.0})]
    text = noise_table(runs)
    assert "| remote:slidingserve | 2 | 3.5 (3.0–4.0) | 1.23 (1.20–1.25) | 45% (40%–50%) | 8% (6%–10%) " \
           "| 1 published, 2 rejected, 1 remargined |" in text
    assert "| vllm |" not in text and noise_table(runs[:1]) == ""


def test_timing_table_sets_client_and_vllm_side_by_side() -> None:
    def run(seed: int, client_ttft: float, vllm_ttft: float) -> dict[str, Any]:
        return {**_run("vllm", 3, seed, 1.0, 1.0),
                "client": {"ttft_mean_ms": client_ttft, "send_late_mean_ms": 1.0, "send_late_max_ms": 4.0 * seed},
                "vllm_timings": {"ttft_mean_ms": vllm_ttft, "queue_mean_ms": 50.0, "prefill_mean_ms": 30.0,
                                 "itl_mean_ms": 20.0}}

    text = timing_table([run(1, 400.0, 300.0), run(2, 600.0, 500.0)])
    assert "| vllm | 3 | 500 | 400 | 50 | 30 | 20 | 1 / 6 | — | — / — | — |" in text
    assert timing_table([_run("vllm", 3, 1, 1.0, 1.0)]) == ""



def test_a_sweep_resumes_only_into_runs_measured_with_the_same_settings(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Runs are keyed by (configuration, rate, seed): a folder measured with another budget
    or SLO must not be taken for done (it once was)."""
    out = tmp_path / "sweep"
    base = ["--configs", "vllm", "--no-aa", "--rates", "2", "--seeds", "1", "--out", str(out)]
    out.mkdir()
    (out / "runs.jsonl").write_text(json.dumps(_run("vllm", 2, 1, 1.0, 1.0)) + "\n")
    (out / "spec.json").write_text(json.dumps(_spec_dict(spec_of(parser().parse_args(base)))))
    assert main(base) == 0 and "already in" in capsys.readouterr().out  # same settings: done
    before = sorted(p.name for p in out.rglob("*"))
    assert main([*base, "--budget", "256"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings (engine differ)" in err[0], err
    assert main([*base, "--tbt-ms", "100"]) == 2 and "(slo differ)" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == before  # nothing measured or written
    # more rates, seeds or configurations extend the sweep
    check_resumable(out, spec_of(parser().parse_args([*base[:6], "1,2", *base[7:]])))
    check_resumable(out, spec_of(parser().parse_args(["--configs", "vllm inproc:slidingserve", *base[2:]])))
    # a folder written before a workload field existed was measured with its default
    old = json.loads((out / "spec.json").read_text())
    for k in ("turns", "think_s"):
        del old["workload"][k]
    (out / "spec.json").write_text(json.dumps(old))
    check_resumable(out, spec_of(parser().parse_args(base)))
    with pytest.raises(ValueError, match="workload differ"):
        check_resumable(out, spec_of(parser().parse_args([*base, "--turns", "2", "--max-prompt", "512"])))


def test_ratio_counts_the_seeds_where_the_baseline_has_no_goodput() -> None:
    runs = [_run("vllm", 2, 1, 1.0, 1.0), _run("vllm", 2, 2, 0.5, 0.5), _run("vllm", 3, 1, 0.5, 0.5),
            _run("vllm", 3, 2, 0.5, 0.5),
            _run("remote:slidingserve", 2, 1, 1.0, 1.0), _run("remote:slidingserve", 2, 2, 1.0, 1.0),
            _run("remote:slidingserve", 3, 1, 1.0, 1.0), _run("remote:slidingserve", 3, 2, 0.5, 0.5)]
    text = markdown(runs, 0.9)
    # seed 1: 3 / 2.2 (vLLM's attainment crosses 90% at 2.2 rps); seed 2: vLLM 0 (under 90% at
    # 2 rps), ours 2.2
    assert "| remote:slidingserve | 2.60 (2.20–3.00) | 1.36× (1.36–1.36), ∞ on 1 |" in text, text


# ---------------------------------------------------------------- the client's own delays
def test_loop_lag_sees_a_blocked_event_loop() -> None:
    import asyncio
    import time

    from clients.live.client import LoopLag

    lag = LoopLag()

    async def main() -> None:
        stop = asyncio.Event()
        t0 = time.monotonic()
        watch = asyncio.create_task(lag.watch(t0, stop))
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # what a busy client does to its loop
        await asyncio.sleep(0.05)
        stop.set()
        await watch

    asyncio.run(main())
    s = lag.summary()
    assert 150 <= s["loop_lag_max_ms"] < 1000 and s["loop_stalled_s"] >= 0.15
    at, _ = max(lag.samples, key=lambda x: x[1])
    assert 0.03 <= at <= 0.1  # the stall began about 50 ms in


def test_frontend_reads_tokens_at_the_end_of_a_stall() -> None:
    from clients.live.sim import Frontend

    fe = Frontend(late_s=np.zeros(3), lag_at=np.array([1.0, 5.0]), lag_s=np.array([0.5, 0.01]), frontend_s=0.2)
    t = np.array([0.5, 1.0, 1.2, 1.49, 1.6, 5.005, 9.0])
    assert fe.read_at(t).tolist() == pytest.approx([0.5, 1.5, 1.5, 1.5, 1.6, 5.01, 9.0])
    # the constant part: the TTFT excess less what the stalls explain on these first tokens
    assert fe.base_s(np.array([1.2, 9.0])) == pytest.approx(0.2 - 0.15)
    assert fe.base_s(np.array([1.0])) == 0.0  # explained by the stall already
    assert Frontend(np.zeros(1), np.zeros(0), np.zeros(0), None).base_s(np.array([1.0])) == 0.0


def test_the_replay_with_the_clients_delays_sees_what_they_cost(tmp_path: Path) -> None:
    """Stalls recorded in a run's frontend file make the replay's tokens late: formula (1)
    drops, and the record says it is the +client replay."""
    from clients.live.runner import frontend_path
    from clients.live.sim import simulate_sweep
    from scheduler_service.core import default_predictor

    cfg = Config.parse("vllm")
    spec = LiveSpec((cfg,), rates=(2.0,), seeds=(1,), workload=WorkloadSpec(requests=30, warmup=5),
                    slo=Slo(1000.0, 50.0))
    n = 35
    stalls = [(float(t), 1.5) for t in np.arange(1.0, 20.0, 2.0)]  # 1.5 s of every 2 s
    path = frontend_path(tmp_path, cfg.label, 2.0, 1)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"late_s": [0.0] * n, "lag": stalls, "frontend_ms": 100.0}))
    bare, client = simulate_sweep(spec, default_predictor(), 0.1, live_dir=tmp_path)
    assert (bare["source"], client["source"]) == ("sim", "sim+client")
    assert client["attain_f1"] < bare["attain_f1"] - 0.3
    assert client["ttft_p50_ms"] > bare["ttft_p50_ms"]
    text = sim_table([{**bare, "source": "live"}], [bare, client])
    assert "+client" in text and "⚠" in next(x for x in text.splitlines() if x.startswith("| vllm"))


@pytest.mark.parametrize("k", [0.7, 1.4])
def test_match_speed_finds_the_speed_a_run_had(k: float) -> None:
    """A run replayed on an engine ``k`` times slower than the cost model: from its mean
    inter-token latency alone, match_speed finds about ``k`` and the replay at that speed
    has the run's inter-token latency."""
    from clients.live.sim import FittedTruth, match_speed, simulate_run
    from scheduler_service.core import default_predictor

    c = Config.parse("inproc:slidingserve")
    spec = LiveSpec((c,), rates=(3.0,), seeds=(1,), workload=WorkloadSpec(requests=40, warmup=5))
    truth = FittedTruth(default_predictor(), 0.1)
    run = simulate_run(spec, c, 3.0, 1, truth.scaled(k))
    assert run["speed"] == k and run["itl_mean_ms"] > 0
    calls: list[float] = []

    def replay(t: FittedTruth) -> dict[str, Any]:
        calls.append(t.scale)
        return simulate_run(spec, c, 3.0, 1, t)

    rec = match_speed(replay, truth, run["itl_mean_ms"])
    assert calls[0] == 1.0 and len(calls) > 1  # it started from the fitted model and had to move
    assert rec["speed"] == pytest.approx(k, rel=0.1)
    assert rec["itl_mean_ms"] == pytest.approx(run["itl_mean_ms"], rel=0.03)
    for bad in (math.nan, 0.0, -3.0):
        with pytest.raises(ValueError, match="live_itl_ms"):
            match_speed(replay, truth, bad)
    with pytest.raises(ValueError, match="scale"):
        truth.scaled(0.0)


@pytest.mark.parametrize(("k", "kp"), [(0.8, 1.3), (1.2, 0.8)])
def test_match_pace_finds_both_factors_a_run_had(k: float, kp: float) -> None:
    """vLLM's scheduler replayed on an engine ``k`` times slower than the cost model, and
    ``kp`` times slower again on the iterations that carry prefill chunks: from the mean
    inter-token latency and the mean prefill time alone, match_pace finds about both."""
    from clients.live.sim import FittedTruth, match_pace, simulate_run
    from scheduler_service.core import default_predictor

    c = Config.parse("vllm")
    spec = LiveSpec((c,), rates=(3.0,), seeds=(1,), workload=WorkloadSpec(requests=40, warmup=5))
    truth = FittedTruth(default_predictor(), 0.1)
    run = simulate_run(spec, c, 3.0, 1, truth.scaled(k, kp))
    assert (run["speed"], run["prefill_speed"]) == (k, kp) and run["prefill_mean_ms"] > 0
    calls: list[tuple[float, float]] = []

    def replay(t: FittedTruth) -> dict[str, Any]:
        calls.append((t.scale, t.prefill_scale))
        return simulate_run(spec, c, 3.0, 1, t)

    rec = match_pace(replay, truth, run["itl_mean_ms"], run["prefill_mean_ms"])
    assert calls[0] == (1.0, 1.0) and len(calls) > 2
    assert rec["speed"] == pytest.approx(k, rel=0.1) and rec["prefill_speed"] == pytest.approx(kp, rel=0.1)
    assert rec["itl_mean_ms"] == pytest.approx(run["itl_mean_ms"], rel=0.03)
    assert rec["prefill_mean_ms"] == pytest.approx(run["prefill_mean_ms"], rel=0.03)
    for bad in (math.nan, 0.0, -3.0):
        with pytest.raises(ValueError, match="live_prefill_ms"):
            match_pace(replay, truth, run["itl_mean_ms"], bad)
    with pytest.raises(ValueError, match="prefill_scale"):
        truth.scaled(1.0, 0.0)


def test_the_sweep_replays_each_run_at_its_own_speed() -> None:
    """With live records holding vLLM's inter-token latency, each run gets a "sim+speed"
    replay, the table a +speed column and the factors a line."""
    from clients.live.sim import simulate_sweep
    from scheduler_service.core import default_predictor

    spec = LiveSpec((Config.parse("vllm"),), rates=(2.0,), seeds=(1, 2), workload=WorkloadSpec(requests=30, warmup=5))
    bare = simulate_sweep(spec, default_predictor(), 0.1)
    live = [{**r, "source": "live", "vllm_timings": {"itl_mean_ms": 1.3 * r["itl_mean_ms"]}} for r in bare]
    sim = simulate_sweep(spec, default_predictor(), 0.1, live=live)
    fast = [r for r in sim if r["source"] == "sim+speed"]
    assert [r["seed"] for r in fast] == [1, 2] and len(sim) == 4
    for r in fast:
        assert r["speed"] > 1.1 and r["live_itl_mean_ms"] > r["itl_mean_ms"] / 1.04
    text = sim_table(live, sim)
    assert "| sim | +speed |" in text and "(the \"+speed\" factor)" in text and "vllm 1." in text
    assert not [r for r in sim if r["source"] == "sim+pace"]  # no prefill time measured: no second factor


def test_the_sweep_replays_each_run_at_its_pace() -> None:
    """With vLLM's prefill time as well, each run at a rate and seed gets a "sim+pace"
    replay whose prefill factor is the one that makes vLLM's own run there match both its
    times; the other configurations take that factor and match their own inter-token
    latency with the first."""
    from clients.live.sim import simulate_sweep
    from scheduler_service.core import default_predictor

    configs = (Config.parse("vllm"), Config.parse("inproc:slidingserve"))
    spec = LiveSpec(configs, rates=(3.0,), seeds=(1,), workload=WorkloadSpec(requests=30, warmup=5))
    bare = simulate_sweep(spec, default_predictor(), 0.1)
    live = [{**r, "source": "live", "vllm_timings": {"itl_mean_ms": 1.1 * r["itl_mean_ms"],
                                                     "prefill_mean_ms": 1.5 * r["prefill_mean_ms"]}} for r in bare]
    sim = simulate_sweep(spec, default_predictor(), 0.1, live=live)
    paced = {r["config"]: r for r in sim if r["source"] == "sim+pace"}
    assert set(paced) == {"vllm", "inproc:slidingserve"}
    assert paced["vllm"]["prefill_speed"] == paced["inproc:slidingserve"]["prefill_speed"] > 1.1
    assert paced["vllm"]["prefill_mean_ms"] == pytest.approx(live[0]["vllm_timings"]["prefill_mean_ms"], rel=0.05)
    for r in paced.values():
        assert r["itl_mean_ms"] == pytest.approx(r["live_itl_mean_ms"], rel=0.03)
    # predicted from vLLM's run alone: at both of its factors, for the adapter's configurations only
    (pred,) = [r for r in sim if r["source"] == "sim+vllm"]
    assert pred["config"] == "inproc:slidingserve"
    assert pred["prefill_speed"] == paced["vllm"]["prefill_speed"]
    assert pred["speed"] == pytest.approx(paced["vllm"]["speed"], rel=0.05)  # both matched vLLM's latency
    assert "| +speed | +pace | +vLLM's |" in sim_table(live, sim)


@pytest.mark.parametrize(("sigma", "bias"), [(0.15, 1.0), (0.3, 0.9), (0.25, 1.15)])
def test_the_noise_is_read_off_the_overrun_shares(sigma: float, bias: float) -> None:
    """Runs that measured the share of iterations over the prediction and over it times the
    learned margin give back the spread of their iteration times, whatever the bias."""
    from clients.live.sim import noise_from_overruns

    rng = np.random.default_rng(7)
    runs: list[dict[str, Any]] = [{"overrun_share": None}, {"service_margin": 1.3}, {}]  # measured nothing
    for m in (1.2, 1.35, 1.5):
        x = bias * np.exp(sigma * rng.standard_normal(20_000) - sigma**2 / 2)
        runs.append({"overrun_share": {"none": float(np.mean(x > 1)), "learned": float(np.mean(x > m))},
                     "service_margin": m})
    runs.append({"overrun_share": {"none": 0.4, "learned": 0.5}, "service_margin": 1.3})  # not a spread: left out
    assert noise_from_overruns(runs) == pytest.approx(sigma, rel=0.08)
    assert noise_from_overruns(runs[:3]) is None


def test_report_only_sim_reads_the_noise_off_the_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--report-only --sim` on a folder of runs: the noise comes from the remote runs'
    overrun shares unless --sim-noise is given, and the report has the +speed replay."""
    from scheduler_service.core import default_predictor

    base = ["--configs", "vllm", "--rates", "2", "--seeds", "1", "--requests", "30", "--warmup", "5",
            "--out", str(tmp_path), "--judge-seeds", "0", "--no-aa"]
    live = {**_run("vllm", 2.0, 1, 0.9, 0.95), "vllm_timings": {"itl_mean_ms": 40.0}}
    remote = {**_run("remote:slidingserve", 2.0, 1, 0.9, 0.95), "mode": "remote", "service_margin": 1.3,
              "overrun_share": {"none": 0.5, "learned": 0.12}}
    (tmp_path / "runs.jsonl").write_text(json.dumps(live) + "\n" + json.dumps(remote) + "\n")
    (tmp_path / "engine_predictor.json").write_text(json.dumps({"predictor": default_predictor().to_dict(), "reports_accepted": 100}))
    assert main([*base, "--report-only", "--sim"]) == 0
    out = capsys.readouterr().out
    assert "iteration-time noise σ 0.22 (read off the remote runs' overrun shares)" in out
    sim = [json.loads(x) for x in (tmp_path / "sim.jsonl").read_text().splitlines()]
    assert [r["source"] for r in sim] == ["sim", "sim+speed"] and {r["noise_sigma"] for r in sim} == {0.22}
    assert "| sim | +speed |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "sim.png").stat().st_size > 10_000 and "sim.png" in out
    assert main([*base, "--report-only", "--sim", "--sim-noise", "0.1"]) == 0
    assert "noise σ" not in capsys.readouterr().out
    assert {json.loads(x)["noise_sigma"] for x in (tmp_path / "sim.jsonl").read_text().splitlines()} == {0.1}
    # another sweep's cost model, to check the replay on runs it was not fitted on
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"predictor": default_predictor().to_dict(), "reports_accepted": 7}))
    assert main([*base, "--report-only", "--sim", str(other), "--sim-noise", "0.1"]) == 0
    assert f"the cost model: {other}" in capsys.readouterr().out
    assert f"({other}: the service's predictor fitted on 7 iteration reports)" in (tmp_path / "report.md").read_text()
    for bad, why in ((tmp_path / "none.json", "run a sweep with a remote configuration first"),
                     (tmp_path / "runs.jsonl", "not an engine_predictor.json")):
        assert main([*base, "--report-only", "--sim", str(bad)]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_remote_runs_late_answers_are_replayed() -> None:
    """The replay of a remote run fails the live run's share of decisions as late: the
    adapter falls back (and backs off) about as often as it did live."""
    from clients.live.sim import FittedTruth, LateAnswers, late_share, simulate_run
    from scheduler_service.core import default_predictor

    live = {"adapter": {"iterations": 1000.0, "planned": 900.0, "native": 100.0, "fallback_deadline": 50.0}}
    assert late_share(live) == 0.05 and late_share({"adapter": {}}) == 0.0 and late_share(None) == 0.0
    c = Config.parse("remote:slidingserve")
    spec = LiveSpec((c,), rates=(3.0,), seeds=(1,), workload=WorkloadSpec(requests=40, warmup=5))
    truth = FittedTruth(default_predictor(), 0.1)
    on_time = simulate_run(spec, c, 3.0, 1, truth)
    assert set(on_time["fallbacks"]) == {"decisions"} and on_time["late_share"] == 0.0
    late = simulate_run(spec, c, 3.0, 1, truth, late=0.2)
    fb = late["fallbacks"]
    asked = fb["decisions"] - fb["circuit_open"]  # a back-off skips the scheduler
    assert 0.15 < fb["deadline"] / asked < 0.25 and fb["circuit_open"] >= fb["deadline"]  # a back-off after each
    assert late["requests"] == late["completed"] == 40  # nothing lost to a late answer
    with pytest.raises(ValueError, match="share"):
        LateAnswers(None, 1.0, 1)  # type: ignore[arg-type]


def test_the_plot_has_a_predictor_panel_only_where_remote_runs_reported_one(tmp_path: Path) -> None:
    """In-process and vLLM runs carry no service predictor error: their plot has three
    panels, not an empty fourth."""
    import matplotlib.pyplot as plt

    def run(config: str, rate: float, seed: int, **extra: Any) -> dict[str, Any]:
        return {"config": config, "rate": rate, "seed": seed, "attain_f1": 0.9, "attain_tpot": 0.95,
                "ttft_max_ms": 1200.0, "time": rate + seed, **extra}

    local = [run(c, r, 1) for c in ("vllm", "inproc:slidingserve") for r in (1.0, 2.0)]
    three = write_plot(local, tmp_path / "local.png", 0.9)
    four = write_plot([*local, *(run("remote:slidingserve", r, 1, service_mae_ms=0.4) for r in (1.0, 2.0))],
                      tmp_path / "remote.png", 0.9)
    assert three is not None and four is not None
    w3, w4 = plt.imread(three).shape[1], plt.imread(four).shape[1]
    assert w3 < 0.8 * w4  # 14.5 against 19 inches wide


# ------------------------------------------------------------------ the A/A noise floor
def test_vllm_runs_twice_per_seed_by_default_and_a_flag_turns_it_off() -> None:
    labels = [c.label for c in spec_of(parser().parse_args([])).configs]
    assert labels == ["vllm", "vllm-again", "inproc:slidingserve", "remote:slidingserve"]
    assert Config.parse("vllm-again").mode == "native"
    assert [c.label for c in spec_of(parser().parse_args(["--no-aa"])).configs] == [
        "vllm", "inproc:slidingserve", "remote:slidingserve"]
    only = spec_of(parser().parse_args(["--configs", "inproc:slidingserve"])).configs
    assert [c.label for c in only] == ["inproc:slidingserve"]  # nothing to run twice


def test_the_aa_band_and_the_verdicts_read_against_it() -> None:
    """The band is the largest difference between vLLM's two runs of one seed; a difference
    from vLLM inside it is "within noise", outside it "ahead" or "behind"."""
    runs = [_run("vllm", 1, 1, 0.90, 0.92), _run("vllm-again", 1, 1, 0.86, 0.92),
            _run("vllm", 1, 2, 0.80, 0.80), _run("vllm-again", 1, 2, 0.81, 0.78),
            _run("inproc:a", 1, 1, 0.91, 0.80), _run("inproc:a", 1, 2, 0.82, 0.70),
            _run("inproc:b", 1, 1, 0.97, 0.97), _run("inproc:b", 1, 2, 0.90, 0.90)]
    band = aa_band(runs)
    assert band[1.0]["attain_f1"] == pytest.approx(4.0) and band[1.0]["attain_tpot"] == pytest.approx(2.0)
    assert band[1.0]["seeds"] == 2
    d, word = verdicts(runs, "inproc:a", 1.0, "attain_f1", band)  # +3 and +1.5 points: inside 4
    assert d == pytest.approx(2.25) and word == "within noise"
    assert verdicts(runs, "inproc:a", 1.0, "attain_tpot", band)[1] == "behind"
    assert verdicts(runs, "inproc:b", 1.0, "attain_f1", band)[1] == "ahead"
    text = aa_table(runs)
    assert "| 1 rps | 2 | 4 / 2 |" in text and "+2 (within noise) / -11 (behind)" in text
    assert aa_table([r for r in runs if r["config"] != "vllm-again"]) == ""


def test_runs_that_shared_the_machine_are_named() -> None:
    quiet = {**_run("vllm", 1, 1, 0.9, 0.9), "foreign_before": 0.05, "foreign_during": 0.1, "shared": False}
    busy = {**_run("inproc:a", 1, 1, 0.9, 0.9), "foreign_before": 0.05, "foreign_during": 1.2, "shared": True}
    assert shared_note([quiet], 0.3) == ""
    note = shared_note([quiet, busy], 0.3)
    assert "1 of 2 runs shared the machine" in note and "inproc:a 1 rps seed 1" in note
    assert "predate the quiet check" in shared_note([_run("vllm", 1, 1, 0.9, 0.9)], 0.3)


def test_foreign_load_is_the_busy_time_less_the_benchmarks_own() -> None:
    # 2 cores over 10 s: the worker's fully busy, the other half busy = 15 core-seconds;
    # the benchmark's processes used 11 of them (the bound threads counted in engine_s already)
    cpu = {"wall_s": 10.0, "worker_core_busy": 1.0, "other_cores_busy": 0.5, "n_other_cores": 1.0,
           "client_s": 2.0, "api_server_s": 1.0, "engine_s": 8.0, "engine_on_worker_s": 7.0}
    assert foreign_share(cpu) == pytest.approx(0.4)
    assert foreign_share({**cpu, "client_s": 9.0}) == 0.0
    assert foreign_share({}) == 0.0


# ------------------------------------------------------------------ the day's capacity
@given(st.floats(0.1, 50.0), st.floats(0.3, 5.0))
def test_the_capacity_search_brackets_the_rate_where_vllm_stops_meeting_the_bar(cap: float, start: float) -> None:
    """With a machine that meets the bar up to ``cap`` and not above, the search returns a
    rate it saw met, at most ``cap``, in at most 6 probes: more than half of ``cap`` once a
    probe missed (the highest probe, all met, otherwise), and within 10% of the lowest
    missed rate wherever it stopped before its last probe; a one-line error where every
    probe missed."""
    seen: list[float] = []

    def probe(rate: float) -> float:
        seen.append(rate)
        return 0.95 if rate <= cap else 0.6

    try:
        got, probes = find_capacity(probe, start=start)
    except RuntimeError as e:  # 6 halvings from the start all above cap: it says so
        assert len(seen) == 6 and min(seen) > cap and f"even at {min(seen):g} req/s" in str(e)
        return
    assert len(probes) == len(seen) <= 6 and probes == [(r, 0.95 if r <= cap else 0.6) for r in seen]
    fails = [r for r in seen if r > cap]
    # (rates are rounded to 0.01 req/s)
    assert got in seen and got <= cap and (got >= cap / 2 - 0.01 if fails else got == max(seen))
    if len(probes) < 6 and fails:
        assert min(fails) <= got * 1.1


def test_the_capacity_search_ignores_a_met_rate_above_a_missed_one() -> None:
    answers = {2.0: 0.95, 4.0: 0.5, 3.0: 0.95, 3.5: 0.5, 3.25: 0.5}
    got, probes = find_capacity(lambda r: answers.get(r, 0.95 if r < 3.1 else 0.5))
    assert got < 3.25 and all(a >= CAPACITY_BAR for r, a in probes if r == got)
    noisy = {2.0: 0.5, 1.0: 0.95, 1.5: 0.5}  # met at 1, missed at 1.5 and 2, then met at 1.25 and 1.4...
    got, _ = find_capacity(lambda r: noisy.get(r, 0.95))
    assert 1.0 <= got < 1.5


def test_the_capacity_search_says_when_even_the_lowest_rate_misses() -> None:
    with pytest.raises(RuntimeError, match=r"fewer than 90%.*0\.05 req/s"):
        find_capacity(lambda r: 0.2, max_probes=20)


def test_rates_are_multiples_of_the_capacity_by_default(tmp_path: Path) -> None:
    spec = spec_of(parser().parse_args([]))
    assert spec.rates == () and spec.loads == (0.5, 0.75, 1.0, 1.25, 1.5) and spec.capacity_rps is None
    given_rates = spec_of(parser().parse_args(["--rates", "2,3"]))
    assert given_rates.rates == (2.0, 3.0) and given_rates.loads == () and resolve_rates(given_rates, tmp_path) is given_rates
    known = resolve_rates(spec_of(parser().parse_args(["--capacity", "1.3"])), tmp_path)
    assert known.rates == (0.65, 0.98, 1.3, 1.62, 1.95) and known.capacity_rps == 1.3
    with pytest.raises(ValueError, match="give --rates or --capacity"):
        resolve_rates(spec, tmp_path)
    (tmp_path / "capacity.json").write_text(json.dumps({
        "capacity_rps": 2.0, "bar": 0.9, "definition": "TTFT+TPOT", "seed": 1000,
        "probes": [{"rate": 2.0, "attain_tpot": 0.93}, {"rate": 4.0, "attain_tpot": 0.41}]}))
    assert resolve_rates(spec, tmp_path).rates == (1.0, 1.5, 2.0, 2.5, 3.0)  # a resumed sweep keeps its rates
    note = capacity_note(tmp_path)
    assert "**2 req/s**" in note and "4 rps 41%" in note
    runs = [{**_run("vllm", 2.0, 1, 0.9, 0.9), "load": 1.0, "capacity_rps": 2.0},
            {**_run("vllm", 3.0, 1, 0.7, 0.6), "load": 1.5, "capacity_rps": 2.0}]
    assert "| 2 rps (1×) | 3 rps (1.5×) |" in markdown(runs, 0.9)
    assert capacity_note(tmp_path / "none") == ""


def test_a_bad_capacity_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["--capacity", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--capacity must be positive" in capsys.readouterr().err
    assert main(["--sim-only", str(Path(__file__).parent.parent / "docs/results/live/engine_predictor.json"),
                 "--out", str(tmp_path / "y")]) == 2
    assert "give --rates or --capacity" in capsys.readouterr().err

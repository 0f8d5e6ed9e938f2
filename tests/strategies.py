"""Hypothesis strategies for valid snapshots and predictors."""

from __future__ import annotations

from hypothesis import strategies as st

from scheduler_service.core import BatchLatencyPredictor, LinearModel, Request, Snapshot

NOW = 100.0


@st.composite
def requests_st(draw: st.DrawFn, *, max_n: int = 10, max_prompt: int = 64, tight: bool = False) -> list[Request]:
    """With ``tight`` SLOs and slacks are a few milliseconds, so decode windows bind."""
    n = draw(st.integers(0, max_n))
    # ids in a random order unrelated to arrival, so id tie-breaks are exercised
    ids = draw(st.permutations([f"r{i:02d}" for i in range(n)]))
    arrivals = st.one_of(st.sampled_from([NOW - 1.0, NOW - 0.5, NOW - 0.1]),
                         st.floats(NOW - 3.0, NOW, allow_nan=False))
    ttfts, tbts, outs = st.floats(0.01, 3.0), st.floats(0.005, 0.3), st.integers(1, 50)
    if tight:
        arrivals = st.floats(NOW - 0.05, NOW)
        ttfts, tbts, outs = st.floats(0.001, 0.06), st.floats(0.0005, 0.02), st.integers(1, 3)
    out = []
    for rid in ids:
        prompt = draw(st.integers(1, max_prompt))
        kind = draw(st.sampled_from(["waiting", "prefilling", "decoding"]))
        computed, output, cached = 0, 0, 0
        if kind == "prefilling" and prompt > 1:
            computed = draw(st.integers(1, prompt - 1))
        elif kind == "waiting" and prompt > 1 and draw(st.booleans()):
            # waiting, with a prefix-cache hit shown as computed (cached_tokens)
            computed = cached = draw(st.integers(1, prompt - 1))
        elif kind == "decoding":
            computed, output = prompt, draw(outs)
        out.append(Request(
            id=rid,
            arrival=draw(arrivals),
            prompt_tokens=prompt,
            computed_tokens=computed,
            output_tokens=output,
            ttft_slo=draw(ttfts),
            tbt_slo=draw(tbts),
            protected=draw(st.booleans()),
            cached_tokens=cached,
        ))
    return out


@st.composite
def snapshots(draw: st.DrawFn, *, max_n: int = 10, max_prompt: int = 64, max_bmax: int = 64) -> Snapshot:
    """Valid snapshots including tight max_num_seqs, tiny free_kv_tokens,
    small B_max, expired requests, protected flags and waiting requests with a cached
    prefix."""
    reqs = draw(requests_st(max_n=max_n, max_prompt=max_prompt, tight=draw(st.booleans())))
    return Snapshot.from_requests(
        reqs,
        now=NOW,
        max_batch_tokens=draw(st.integers(1, max_bmax)),
        max_num_seqs=draw(st.one_of(st.integers(1, 4), st.integers(1, 300))),
        free_kv_tokens=draw(st.one_of(st.none(), st.integers(0, 8), st.integers(0, 500))),
        prefill_throughput=draw(st.one_of(st.none(), st.floats(100.0, 1e5))),
    )


def linear_models(*, negative: bool = False) -> st.SearchStrategy[LinearModel]:
    lo = -1.0 if negative else 0.0
    scales = (1e-5, 1e-5, 1e-4, 0.1, 1e-4, 0.02, 0.01)
    return st.builds(
        lambda ic, ws: LinearModel(ic, tuple(w * s for w, s in zip(ws, scales, strict=True))),
        st.floats(0.1, 10.0),
        st.lists(st.floats(lo, 1.0), min_size=7, max_size=7),
    )


@st.composite
def predictors(draw: st.DrawFn, *, negative: bool = False) -> BatchLatencyPredictor:
    m = linear_models(negative=negative)
    return BatchLatencyPredictor(
        scenarios={k: draw(st.one_of(st.none(), m)) for k in ("decode", "prefill", "mixed")},
        global_model=draw(m),
    )

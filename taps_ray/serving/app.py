"""The Serve application: one Drafter deployment per configured drafter, the Verifier, the Ingress.

``application(cfg)`` builds it from an :class:`~taps_ray.config.ExperimentConfig`; ``build_app``
is the builder ``serve run`` / ``serve deploy`` import (``taps_ray.serving.app:build_app``) with
``args`` = :class:`AppArgs`.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from taps_ray.config import ConfigError, ExperimentConfig, ServeConfig, apply_overrides, load_config
from taps_ray.runtime import ray_compat
from taps_ray.serving.access import exposure_refusal, open_warning, resolve_api_keys
from taps_ray.serving.drafter import Drafter, SessionAffinityRouter
from taps_ray.serving.ingress import Ingress
from taps_ray.serving.plan import VERIFIER_DEPLOYMENT, drafter_deployment_name, resolve_plan
from taps_ray.serving.protocol import RequestError
from taps_ray.serving.verifier import Verifier

log = logging.getLogger(__name__)
INTERNAL_LOGGING = {"enable_access_log": False}
"""Drafter and Verifier calls happen every decoding step: no Serve access-log line for each."""

SESSION_GRACE_S = 60.0
INGRESS_HEADROOM = 64


class AppArgs(BaseModel):
    """``args`` of the application builder: an experiment YAML ``config`` (a path the Serve
    controller's node can read) and/or an inline ``experiment`` mapping, plus dotted ``overrides``."""

    model_config = ConfigDict(extra="forbid")

    config: str | None = None
    experiment: dict[str, Any] | None = None
    overrides: list[str] = Field(default_factory=list)

    def load(self) -> ExperimentConfig:
        if self.config is not None:
            cfg = load_config(self.config, self.overrides)
            if self.experiment:
                raw = cfg.model_dump()
                raw["serve"].setdefault("http", {})["api_keys"] = list(cfg.serve.http.api_keys)
                raw.update(self.experiment)
                return ExperimentConfig.model_validate(apply_overrides(raw, self.overrides))
            return cfg
        try:
            return ExperimentConfig.model_validate(apply_overrides(dict(self.experiment or {}), self.overrides))
        except Exception as err:
            raise ConfigError(f"invalid experiment in serve args: {err}") from err


def drafter_user_config(cfg: ExperimentConfig, name: str) -> dict:
    """The hot-swappable ``user_config`` of drafter ``name``: its weights and fault injection."""
    d = cfg.serve.drafters[name]
    if d.average_of:
        parts = [{"checkpoint": cfg.serve.drafters[p].checkpoint, "seed": cfg.serve.drafters[p].seed}
                 for p in d.average_of]
        weights = {"average": parts, "alpha": d.alpha}
    else:
        weights = {"checkpoint": d.checkpoint, "seed": d.seed}
    return {**weights, "fault": d.fault, "delay_s": d.delay_s}


def application(cfg: ExperimentConfig):
    """The bound Serve application (ingress at the route prefix)."""
    s = cfg.serve
    try:
        resolve_plan(None, None, s)
    except RequestError as err:
        raise ConfigError(f"serve.strategy: {err.message}") from None
    target, tree = cfg.target.model_dump(), cfg.tree.model_dump()
    ttl = s.limits.request_timeout_s + SESSION_GRACE_S
    router = RequestRouterConfig(request_router_class=SessionAffinityRouter)
    drafters = {}
    for name, d in s.drafters.items():
        options: dict[str, Any] = dict(
            name=drafter_deployment_name(name), user_config=drafter_user_config(cfg, name),
            max_ongoing_requests=d.max_ongoing_requests, request_router_config=router, health_check_period_s=2.0,
            ray_actor_options={"num_cpus": d.num_cpus, "num_gpus": d.num_gpus, "resources": dict(d.resources)},
            logging_config=INTERNAL_LOGGING,
        )
        if d.autoscaling:
            options["autoscaling_config"] = d.autoscaling
        else:
            options["num_replicas"] = d.num_replicas
        drafters[name] = serve.deployment(Drafter).options(**options).bind(name, target, tree, ttl, d.threads,
                                                                          d.batch_sessions, s.batching.wait_ms / 1000)
    verifier = serve.deployment(Verifier).options(
        name=VERIFIER_DEPLOYMENT, num_replicas=s.verifier.num_replicas, max_ongoing_requests=s.admission.max_concurrent_requests,
        max_queued_requests=s.admission.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=s.admission.retry_after_s),
        ray_actor_options={"num_cpus": s.verifier.num_cpus, "num_gpus": s.verifier.num_gpus,
                           "resources": dict(s.verifier.resources)},
        logging_config=INTERNAL_LOGGING,
    ).bind(target, tree, s.model_dump(), drafters)
    model_name = s.model_name or served_model_name(cfg.target.model)
    ongoing, queued = ingress_limits(s)
    return serve.deployment(Ingress).options(
        name="Ingress", num_replicas=s.ingress.num_replicas, max_ongoing_requests=ongoing, max_queued_requests=queued,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=s.admission.retry_after_s),
        ray_actor_options={"num_cpus": s.ingress.num_cpus},
    ).bind(verifier, s.model_dump(), cfg.sampling.model_dump(), model_name, [cfg.target.model],
           resolve_api_keys(s.http.api_keys))


def ingress_limits(s: ServeConfig) -> tuple[int, int]:
    """``max_ongoing_requests`` and ``max_queued_requests`` of an ingress replica: room for every request
    the verifiers decode and queue (each holds an ingress slot while it streams) plus
    :data:`INGRESS_HEADROOM` for probes, metrics and the at-once 429s, so ``/health`` never waits behind
    decoding. Past both, Serve's proxy itself answers 503 with ``Retry-After`` (a plain-text body)."""
    ongoing = s.verifier.num_replicas * s.admission.max_concurrent_requests + s.admission.max_queued_requests + INGRESS_HEADROOM
    return ongoing, ongoing


def served_model_name(target: str) -> str:
    """``embedded:smollm2-135m`` -> ``smollm2-135m``, ``hf:org/name`` -> ``org/name``."""
    return target.split(":", 1)[1] if target.split(":", 1)[0] in ("embedded", "hf") else target


def build_app(args: dict):
    """Application builder for ``serve run`` / ``serve deploy`` (``import_path: taps_ray.serving.app:build_app``);
    ``args`` as :class:`AppArgs` (Serve passes the config's ``args`` mapping). Built where a Serve controller
    runs, it fails closed like ``taps serve``: ConfigError, before any deployment starts, when the controller's
    HTTP address is beyond loopback and there are no API keys (:func:`~taps_ray.serving.access.exposure_refusal`;
    the ingress checks again when it starts, :func:`~taps_ray.serving.ingress.served_host`)."""
    cfg = (args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})).load()
    host = ray_compat.serve_http_host()
    if host is not None:
        try:
            keys = resolve_api_keys(cfg.serve.http.api_keys)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if refusal := exposure_refusal(host, keys, cfg.serve.http.allow_unauthenticated):
            raise ConfigError(refusal)
    return application(cfg)


def run(cfg: ExperimentConfig, host: str | None = None, port: int | None = None, blocking: bool = True):
    """Start (or join, with ``RAY_ADDRESS``) a Ray cluster, deploy the application on ``host:port`` and,
    when ``blocking``, serve until Ctrl-C or SIGTERM (the application is deleted on the way out). ValueError,
    before anything starts, for a bind beyond loopback without API keys (:func:`~taps_ray.serving.access.
    exposure_refusal`) or a blank ``TAPS_API_KEY``."""

    from taps_ray.runtime.cluster import init_ray

    host = host or cfg.serve.http.host
    port = port or cfg.serve.http.port
    keys = resolve_api_keys(cfg.serve.http.api_keys)
    refusal = exposure_refusal(host, keys, cfg.serve.http.allow_unauthenticated)
    if refusal:
        raise ValueError(refusal)
    init_ray()
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(cfg), name=cfg.serve.app_name, route_prefix="/", blocking=False)
    url = f"http://{host}:{port}"
    log.info("serving %s at %s/v1 (strategy %s, drafters %s); Ctrl-C to stop", cfg.target.model, url,
             cfg.serve.strategy, list(cfg.serve.drafters))
    if not keys:
        log.warning(open_warning(host))
    if not blocking:
        return url
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log.info("shutting down %s", cfg.serve.app_name)
        serve.delete(cfg.serve.app_name)
    return url


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt

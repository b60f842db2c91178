"""Deployment artifacts: the Serve configs validate against Serve's schema and build the taps_ray
application; the builder's arguments and limits. (The RayJob and cluster.yaml are checked in
tests/test_deployments.py.)"""

from __future__ import annotations

import pytest
import yaml
from ray._common.utils import import_attr
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from taps_ray.serving.app import AppArgs, application, build_app, drafter_deployment_name, drafter_user_config
from tests.conftest import REPO


def _serve_schema(raw: dict) -> ServeDeploySchema:
    """Validated with Serve's schema; each application built the way the Serve controller builds it."""
    schema = ServeDeploySchema.model_validate(raw)
    for app in schema.applications:
        builder = import_attr(app.import_path)
        assert isinstance(call_user_app_builder_with_args_if_necessary(builder, app.args), Application)
    return schema


def test_serve_config_parses_into_serve_deploy_schema_and_builds():
    raw = yaml.safe_load((REPO / "deployments/serve_config.yaml").read_text())
    schema = _serve_schema(raw)
    assert schema.http_options.host == "127.0.0.1"
    cfg = AppArgs(**schema.applications[0].args).load()
    assert set(cfg.serve.drafters) == {"math", "chat"} and cfg.serve.drafters["chat"].autoscaling
    assert isinstance(build_app(AppArgs(**schema.applications[0].args)), Application)
    overrides = {d.name: d.user_config for d in schema.applications[0].deployments}
    assert overrides == {drafter_deployment_name(n): drafter_user_config(cfg, n) for n in cfg.serve.drafters}, \
        "the in-place swap knobs must start equal to what the builder deploys"


def test_app_args_take_a_config_path_overrides_and_reject_bad_strategies():
    args = AppArgs(config=str(REPO / "configs/demo.yaml"),
                   overrides=["serve.strategy=merged:budget", "serve.drafters={a: null, b: {seed: 3}}"])
    cfg = args.load()
    assert cfg.name == "demo" and cfg.serve.strategy == "merged:budget" and cfg.serve.drafters["b"].seed == 3
    application(cfg)
    with pytest.raises(ValueError, match="serve.strategy"):
        application(AppArgs(experiment={"serve": {"strategy": "routed:nope"}}).load())
    with pytest.raises(ValueError, match="average_of names 'zzz'"):
        AppArgs(experiment={"serve": {"drafters": {"a": None, "avg": {"average_of": ["a", "zzz"]}}}}).load()


def test_rayservice_manifest_embeds_a_valid_serve_config():
    manifest = yaml.safe_load((REPO / "deployments/rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    _serve_schema(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    workers = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert workers["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_queue_limits_reach_the_deployments():
    """The verifier's slots and queue are the config's, its refusals 429 with Retry-After; the ingress
    has room for all of them and its probes."""
    from taps_ray.serving.app import INGRESS_HEADROOM

    cfg = AppArgs(experiment={"serve": {"drafters": {"a": None}, "admission": {
        "max_concurrent_requests": 3, "max_queued_requests": 5, "retry_after_s": 2.5}}}).load()
    ingress = application(cfg)._bound_deployment
    verifier = ingress.init_args[0]._bound_deployment
    assert (verifier.name, verifier.max_ongoing_requests, verifier.max_queued_requests) == ("Verifier", 3, 5)
    assert verifier.backpressure_config.status_code == 429 and verifier.backpressure_config.retry_after_s == 2.5
    assert ingress.max_ongoing_requests == ingress.max_queued_requests == 3 + 5 + INGRESS_HEADROOM
    for bad in ({"max_queued_requests": 0}, {"retry_after_s": 0}, {"retry_after_s": float("inf")}):
        with pytest.raises(ValueError):
            AppArgs(experiment={"serve": {"drafters": {"a": None}, "admission": bad}}).load()

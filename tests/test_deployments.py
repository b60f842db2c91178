"""The cluster files deploy as written: cluster.yaml passes Ray's own cluster schema and its commented commands
parse with Ray's and our CLIs; the KubeRay manifests use only current CRD fields; the RayJob retries with
``--resume`` and writes the drafters the RayService serves; gated targets get HF_TOKEN from a secret; the GPU
fractions hold what each replica loads."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import torch
import yaml
from transformers import LlamaConfig

from taps_ray.cli import build_parser
from taps_ray.config import load_config
from taps_ray.models.drafter import DraftHead
from taps_ray.serving.app import AppArgs
from tests.conftest import REPO

DEPLOYMENTS = REPO / "deployments"
CLUSTER_YAML = REPO / "cluster.yaml"

# Spec fields of the KubeRay v1 CRDs (ray-project/kuberay ray-operator/apis/ray/v1, v1.7), minus the
# deprecated ones, which the operator ignores (kuberay#1685).
DEPRECATED = {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"}
RAYJOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
               "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint", "runtimeEnvYAML",
               "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus", "entrypointNumGpus",
               "ttlSecondsAfterFinished", "preRunningDeadlineSeconds", "shutdownAfterJobFinishes", "suspend"}
RAYSERVICE_SPEC = {"rayClusterDeletionDelaySeconds", "serveService", "upgradeStrategy", "managedBy", "serveConfigV2",
                   "rayClusterConfig", "excludeHeadPodFromServeSvc", "suspend"}
RAYCLUSTER_SPEC = {"upgradeStrategy", "authOptions", "suspend", "managedBy", "autoscalerOptions",
                   "headServiceAnnotations", "enableInTreeAutoscaling", "gcsFaultToleranceOptions",
                   "historyServerOptions", "networkPolicy", "tlsOptions", "headGroupSpec", "rayVersion",
                   "workerGroupSpecs"}
HEAD_GROUP = {"template", "headService", "enableIngress", "ingressOptions", "resources", "labels", "rayStartParams",
              "serviceType"}
WORKER_GROUP = {"suspend", "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds", "priority",
                "resources", "labels", "rayStartParams", "template", "scaleStrategy", "numOfHosts"}
SPEC_FIELDS = {"RayJob": (RAYJOB_SPEC, "rayClusterSpec"), "RayService": (RAYSERVICE_SPEC, "rayClusterConfig")}

GPU_BYTES = 24e9  # the manifests ask for GPUs of >= 24 GB (A10G, L4 or larger)
CUDA_CONTEXT_BYTES = 0.6e9
# meta-llama/Meta-Llama-3-8B-Instruct config.json (the manifests' target): untied embedding and LM head
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False)


def manifest(name: str) -> dict:
    return yaml.safe_load((DEPLOYMENTS / name).read_text())


def rayjob() -> dict:
    return manifest("rayjob-train.yaml")


def rayservice() -> dict:
    return manifest("rayservice.yaml")


def serve_config() -> dict:
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


def taps_commands(shell: str) -> list[list[str]]:
    """The ``taps`` commands of a shell line (``a && b``), as argv lists without the leading ``taps``; ``cd`` and
    ``VAR=value`` prefixes dropped."""
    commands = []
    for part in shell.split("&&"):
        argv = [a for a in shlex.split(part) if not re.fullmatch(r"[A-Z_]+=.*", a)]
        if argv and argv[0] == "taps":
            commands.append(argv[1:])
    return commands


def train_command(shell: str):
    (argv,) = [a for a in taps_commands(shell) if a[0] == "train"]
    return build_parser().parse_args(argv)


def walk_pods(cluster: dict):
    yield "head", cluster["headGroupSpec"]
    for group in cluster.get("workerGroupSpecs", []):
        yield group["groupName"], group


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def gpus(group: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) for c in containers(group))


def secret_env(group: dict, name: str) -> dict | None:
    for c in containers(group):
        for env in c.get("env", []):
            if env["name"] == name:
                return env.get("valueFrom", {}).get("secretKeyRef")
    return None


# -- cluster.yaml ------------------------------------------------------------------------------------------------

def test_cluster_yaml_passes_rays_cluster_schema():
    """Ray's schema as written, and the launcher's own checks once it has filled in its defaults; the
    repository is mounted where the setup commands install it from."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    jsonschema.validate(config, schema)
    validate_config(prepare_config(yaml.safe_load(CLUSTER_YAML.read_text())))
    commands = [c for key in ("initialization_commands", "setup_commands", "head_setup_commands",
                              "worker_setup_commands") for c in config.get(key) or []]
    repo = {remote for remote, local in config["file_mounts"].items() if local == "."}
    installs = [shlex.split(c)[-1].replace("$HOME", "~") for c in commands if "pip install -e" in c]
    assert repo and installs and set(installs) <= repo, f"installs {installs}, the repository is mounted at {repo}"
    for command in commands:
        assert not re.search(r"[\"']~", command), f"a quoted ~ is not expanded: {command}"


def cluster_commands() -> list[list[str]]:
    """The `ray ...` lines of cluster.yaml's comment, without their parenthesised notes."""
    return [shlex.split(line.removeprefix("#").split("   (")[0]) for line in CLUSTER_YAML.read_text().splitlines()
            if re.match(r"#\s+ray ", line)]


def test_cluster_yaml_comment_commands_parse(monkeypatch):
    """Every `ray ...` command in the comment parses with Ray's own CLI (options and arguments); the
    `taps ...` commands they run parse with ours, and their configs and overrides load."""
    import click
    from ray.scripts.scripts import cli

    monkeypatch.chdir(REPO)
    commands = cluster_commands()
    assert len(commands) >= 5
    names = [" ".join(c[1:3]) for c in commands]
    assert any(n.startswith("job submit") for n in names) and not any(n.startswith("submit ") for n in names)
    trained = []
    for argv in commands:
        command, rest = cli, argv[1:]
        while isinstance(command, click.Group):
            command = command.commands[rest[0]]
            rest = rest[1:]
        ctx = command.make_context(argv[1], rest)
        shell = " ".join(ctx.params.get("entrypoint") or [ctx.params.get("cmd") or ""])
        for taps_argv in taps_commands(shell.removeprefix("bash -c ")):
            args = build_parser().parse_args(taps_argv)
            cfg = load_config(REPO / args.config, getattr(args, "overrides", []))
            if args.command == "train":
                assert args.resume
                trained.append((cfg, args))
        if argv[1:3] == ["job", "submit"] and "taps prepare" in shell:
            assert ctx.params["entrypoint_num_gpus"] >= 1, "taps prepare loads the full target on a GPU"
    assert trained, "the comment shows how to train"
    cluster = yaml.safe_load(CLUSTER_YAML.read_text())
    node_gpus = {name: t["resources"].get("GPU", 0) * t.get("max_workers", 0)
                 for name, t in cluster["available_node_types"].items()}
    for cfg, args in trained:
        workers = sum(cfg.variant_train(v).num_workers for v in cfg.variants if v.name in args.variants.split(","))
        assert workers <= sum(node_gpus.values())


# -- KubeRay manifests ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["rayjob-train.yaml", "rayservice.yaml"])
def test_manifest_fields_are_current_kuberay_crd_fields(name):
    doc = manifest(name)
    assert doc["apiVersion"] == "ray.io/v1"
    allowed, cluster_key = SPEC_FIELDS[doc["kind"]]
    spec = doc["spec"]
    assert not DEPRECATED & set(spec), f"deprecated fields {DEPRECATED & set(spec)}"
    assert set(spec) <= allowed, f"not RayJob/RayService spec fields: {set(spec) - allowed}"
    cluster = spec[cluster_key]
    assert set(cluster) <= RAYCLUSTER_SPEC, set(cluster) - RAYCLUSTER_SPEC
    assert cluster["rayVersion"] == ray.__version__
    assert set(cluster["headGroupSpec"]) <= HEAD_GROUP, set(cluster["headGroupSpec"]) - HEAD_GROUP
    for group in cluster["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP, set(group) - WORKER_GROUP
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_serve_configs_validate():
    from ray.serve.schema import ServeDeploySchema

    local = yaml.safe_load((DEPLOYMENTS / "serve_config.yaml").read_text())
    for config in (serve_config(), local):
        ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
            else ServeDeploySchema.parse_obj(config)
        for app in config["applications"]:
            AppArgs(**app["args"]).load()


def test_rayjob_retries_with_resume_and_a_fresh_run_accepts_it(tmp_path):
    from taps_ray.train.launch import prepare_outputs

    job = rayjob()
    spec = job["spec"]
    assert job["kind"] == "RayJob" and spec["shutdownAfterJobFinishes"] is True
    assert spec["backoffLimit"] >= 1
    entrypoint = spec["entrypoint"]
    commands = taps_commands(entrypoint)
    assert [c[0] for c in commands] == ["prepare", "train"]
    args = train_command(entrypoint)
    assert args.resume and not args.force
    cfg = load_config(REPO / args.config, args.overrides)
    variants = [v for v in cfg.variants if v.name in args.variants.split(",")]
    assert len(variants) == len(args.variants.split(","))
    fresh = prepare_outputs(cfg, tmp_path, variants, "resume")
    assert [v.name for v in fresh] == [v.name for v in variants]
    assert all((tmp_path / "drafters" / v.name / "variant.json").exists() for v in variants)


def mounts(group: dict) -> dict[str, str]:
    """mountPath -> persistentVolumeClaim name of a pod group."""
    volumes = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
               for v in group["template"]["spec"].get("volumes", [])}
    return {m["mountPath"]: volumes.get(m["name"]) for c in containers(group) for m in c.get("volumeMounts", [])}


def on_claim(path: str, group: dict) -> str | None:
    return next((claim for mount, claim in mounts(group).items() if claim and path.startswith(mount.rstrip("/") + "/")),
                None)


def test_serve_reads_the_drafters_the_rayjob_writes():
    job = rayjob()["spec"]
    args = train_command(job["entrypoint"])
    cfg = load_config(REPO / args.config, args.overrides)
    assert (REPO / args.config).is_file() and yaml.safe_load(job["runtimeEnvYAML"])["working_dir"] == "/app"
    run_dir = Path(cfg.output_dir) / cfg.name
    assert run_dir.is_absolute()
    written = {str(run_dir / "drafters" / name) for name in args.variants.split(",")}

    served = serve_config()["applications"][0]["args"]["experiment"]
    checkpoints = {d["checkpoint"] for d in served["serve"]["drafters"].values()}
    assert checkpoints and checkpoints <= written, f"served {checkpoints}, trained {written}"
    assert served["target"]["model"] == cfg.target.model

    env = yaml.safe_load(job["runtimeEnvYAML"])["env_vars"]
    for name, group in walk_pods(job["rayClusterSpec"]):  # the driver and the workers see one volume
        assert on_claim(str(run_dir) + "/", group) == "taps-checkpoints", name
        assert on_claim(env["TAPS_CACHE"] + "/", group) == "taps-checkpoints", name
    for name, group in walk_pods(rayservice()["spec"]["rayClusterConfig"]):
        if gpus(group):  # drafters run on the GPU workers
            for path in checkpoints:
                assert on_claim(path, group) == "taps-checkpoints", name


def test_gated_target_reads_hf_token_from_a_secret():
    for doc, cluster_key in ((rayjob(), "rayClusterSpec"), (rayservice(), "rayClusterConfig")):
        assert "HF_TOKEN" not in doc["spec"].get("runtimeEnvYAML", "")
        for name, group in walk_pods(doc["spec"][cluster_key]):
            if gpus(group) or doc["kind"] == "RayJob":  # pods that load the target, or run the job's driver
                ref = secret_env(group, "HF_TOKEN")
                assert ref and ref["name"] and ref["key"], f"{doc['kind']} {name}: no HF_TOKEN from a secret"


def drafter_replica_bytes(config: LlamaConfig, sessions: int, context: int) -> float:
    """GPU bytes of one drafter replica in bf16: the target's embedding and LM head (item: only those are
    loaded), the one-layer draft head, its KV caches for ``sessions`` x ``context`` and the CUDA context."""
    with torch.device("meta"):
        head = DraftHead(config)
    params = sum(p.numel() for p in head.parameters())
    tables = (1 if config.tie_word_embeddings else 2) * config.vocab_size * config.hidden_size
    kv = sessions * context * 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    return 2 * (params + tables + kv) + CUDA_CONTEXT_BYTES


def test_gpu_fractions_fit_what_replicas_load():
    config = LlamaConfig(**LLAMA3_8B)
    serve = serve_config()["applications"][0]["args"]["experiment"]
    assert serve["target"]["model"] == "hf:meta-llama/Meta-Llama-3-8B-Instruct" and serve["target"]["dtype"] == "bfloat16"
    assert "GPUs of >= 24 GB" in (DEPLOYMENTS / "rayservice.yaml").read_text()
    full_target = 2 * 8.03e9
    sessions = serve["serve"]["admission"]["max_concurrent_requests"]
    per_replica = drafter_replica_bytes(config, sessions, config.max_position_embeddings)
    drafters = serve["serve"]["drafters"]
    for name, d in drafters.items():
        share = d["num_gpus"] * GPU_BYTES
        assert per_replica <= share < full_target, f"drafter {name}: {per_replica / 1e9:.1f} GB in {share / 1e9:.1f} GB"
    assert serve["serve"]["verifier"]["num_gpus"] * GPU_BYTES > full_target
    # the GPU workers hold the verifier and the largest drafter set
    worst = serve["serve"]["verifier"]["num_gpus"] + sum(
        d["num_gpus"] * (d.get("autoscaling", {}).get("max_replicas") or d.get("num_replicas", 1)) for d in drafters.values())
    (group,) = [g for _, g in walk_pods(rayservice()["spec"]["rayClusterConfig"]) if gpus(g)]
    assert worst <= group["maxReplicas"] * gpus(group)

    job = rayjob()["spec"]
    args = train_command(job["entrypoint"])
    cfg = load_config(REPO / args.config, args.overrides)
    workers = sum(cfg.variant_train(v).num_workers for v in cfg.variants if v.name in args.variants.split(","))
    available = sum(g["maxReplicas"] * gpus(g) for _, g in walk_pods(job["rayClusterSpec"]) if gpus(g))
    assert job.get("entrypointNumGpus", 0) + workers <= available


# -- Ray's control plane ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["rayjob-train.yaml", "rayservice.yaml"])
def test_kuberay_clusters_run_with_rays_token_authentication(name):
    doc = manifest(name)
    cluster = doc["spec"][SPEC_FIELDS[doc["kind"]][1]]
    assert cluster["authOptions"] == {"mode": "token"}
    assert "networkpolicy.yaml" in (DEPLOYMENTS / name).read_text()


def test_network_policy_admits_only_the_cluster_to_rays_ports():
    """Every ingress rule that reaches Ray's GCS, dashboard / jobs API, client or metrics ports names its sources
    (the clusters' own pods, the operator, the RayJob's submitter); the one rule open to everyone is the serve
    port's."""
    policy = manifest("networkpolicy.yaml")
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/created-by": "kuberay-operator"}
    ray_ports = {6379, 8265, 10001, 8080}
    open_rules = []
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])} or None  # None: every port
        if not rule.get("from"):
            open_rules.append(ports)
            continue
        for source in rule["from"]:
            assert source.get("podSelector", {}).get("matchLabels"), source
    assert open_rules == [{8000}], open_rules
    assert not any(ports is None or ports & ray_ports for ports in open_rules)
    job = rayjob()["metadata"]["name"]
    assert any(s["podSelector"]["matchLabels"].get("batch.kubernetes.io/job-name") == job
               for rule in policy["spec"]["ingress"] for s in rule.get("from", []))


def test_cluster_yaml_starts_ray_with_a_token_and_serve_joins_it():
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token ray start" in c for c in starts), starts
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    commands = cluster_commands()
    assert ["ray", "get-auth-token", "--generate"] in commands
    serve = [c for c in commands if c[1] == "exec" and "taps serve" in c[-1]]
    assert serve and all("RAY_ADDRESS=auto" in c[-1] for c in serve), serve

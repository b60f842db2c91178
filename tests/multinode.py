"""Multi-node scenarios on a real ``ray.cluster_utils.Cluster`` (several raylets on this machine, the way
Ray tests itself), each run in its own process by ``tests/test_multinode.py`` so that its cluster never
meets the in-process session cluster of the other test modules (``tests/conftest.py``: ``ray_session``).

``python -m tests.multinode SCENARIO DIR`` (``serving``; ``training``, a drill not yet in the tests) prints one line ``RESULT <json>`` and exits 0 when the scenario's
checks pass; the cluster is shut down on every path out (``finally``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

OBJECT_STORE = 80 * 1024 * 1024


@contextmanager
def two_node_cluster(head: dict, worker: dict) -> Iterator[tuple[object, object]]:
    """A head node and one more node (``ray.cluster_utils.Cluster``, no dashboard), this process connected
    as the driver; yields (cluster, the second node). Disconnects and shuts the cluster down after."""
    import ray
    from ray.cluster_utils import Cluster

    from taps_ray.runtime.cluster import set_ray_env

    set_ray_env()
    for attempt in (1, 2):  # Ray gives a node 30 s to register (fixed in ray/_private/node.py): one more on a loaded box
        try:
            cluster = Cluster(initialize_head=True, head_node_args={
                "include_dashboard": False, "object_store_memory": OBJECT_STORE, **head})
            break
        except Exception as err:
            if attempt == 2 or "timed out during startup" not in str(err):
                raise
            print(f"the head node did not register in time ({err}); starting it again", flush=True)
    try:
        node = cluster.add_node(object_store_memory=OBJECT_STORE, **worker)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        yield cluster, node
    finally:
        ray.shutdown()
        cluster.shutdown()


def storage_check(tmp: str) -> dict:
    """:func:`check_shared_storage` on the connected multi-node cluster of one machine (one filesystem):
    every node sees the marker, so the directory passes as ``shared``; no marker is left behind."""
    from pathlib import Path

    from taps_ray.runtime.storage import MARKER_PREFIX, alive_nodes, check_shared_storage

    nodes = alive_nodes()
    assert len(nodes) == 2, nodes
    started = time.monotonic()
    decision = check_shared_storage(tmp)
    assert decision == "shared", decision
    assert not [p for p in Path(tmp).iterdir() if p.name.startswith(MARKER_PREFIX)]
    return {"decision": decision, "nodes": len(nodes), "check_s": round(time.monotonic() - started, 2)}


PROMPTS = ["What is 7 times 8?", "Name three colours of the rainbow.", "Count from one to five.",
           "What is the capital of France?"]
NEW = 8
TREE = {"depth": 2, "top_k": 2, "total_tokens": 5, "adaptive": False}  # a fixed tree: an untrained drafter still drafts


def serving(tmp: str) -> dict:
    """The shared-storage check on the two nodes (:func:`storage_check`); then the Verifier on the head
    node (resource ``verifier_node``), drafter ``a``'s replica on the other (``drafter_node``). Greedy outputs equal in-process ``generate`` with the same drafter; then the
    drafter node is removed while requests are in flight, and those and later requests still answer
    the same text (the verifier skips the unreachable drafter and decodes plainly)."""
    import requests
    import torch
    from ray import serve

    from taps_ray.config import TreeConfig, load_config
    from taps_ray.models.target import TargetModel
    from taps_ray.serving.app import VERIFIER_DEPLOYMENT, application, drafter_deployment_name
    from taps_ray.spec.decoder import generate, load_drafter
    from taps_ray.spec.protocol import SingleStrategy
    from tests.serving.helpers import free_port

    torch.set_num_threads(1)
    cfg = load_config(None, [
        f"tree={json.dumps(TREE)}", "target.threads=1", "target.dtype=float32",
        "serve.drafters={a: {seed: 0, num_cpus: 1, resources: {drafter_node: 1}}}",
        "serve.verifier.resources={verifier_node: 1}", "serve.verifier.num_cpus=0.5", "serve.ingress.num_cpus=0.25",
        "serve.routing.draft_deadline_s=0.5", "serve.routing.max_draft_deadline_s=5", "serve.admission.max_concurrent_requests=4", "serve.limits.request_timeout_s=120",
    ])
    app = "taps-multinode"
    with two_node_cluster({"num_cpus": 2, "resources": {"verifier_node": 1}},
                          {"num_cpus": 1, "resources": {"drafter_node": 1}}) as (cluster, drafter_node):
        import ray

        shared = storage_check(tmp)  # the same cluster serves the storage check's positive path

        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        starting = threading.Thread(target=serve.run, args=(application(cfg),),
                                    kwargs={"name": app, "route_prefix": "/", "blocking": False})
        starting.start()
        target = TargetModel.load(cfg.target)
        drafter = load_drafter(target, None, 0)
        expected = {p: generate(target, [{"role": "user", "content": p}],
                                SingleStrategy(drafter, TreeConfig(**TREE)), max_new_tokens=NEW).text
                    for p in PROMPTS}
        starting.join()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"

        def ask(prompt: str, **taps) -> dict:
            body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
                    "temperature": 0, "max_tokens": NEW, "taps": taps}
            reply = requests.post(url, json=body, timeout=180)
            assert reply.status_code == 200, (reply.status_code, reply.text)
            return reply.json()

        head_id = ray.get_runtime_context().get_node_id()
        # the drafter's replica takes the second node's one CPU, so the ingress (and its HTTP proxy, HeadOnly)
        # stay on the head node with the verifier: only drafting crosses nodes
        info = serve.get_deployment_handle(VERIFIER_DEPLOYMENT, app).info.remote().result(timeout_s=60)
        stats = serve.get_deployment_handle(drafter_deployment_name("a"), app).stats.remote().result(timeout_s=60)
        assert info["node_id"] == head_id, (info["node_id"], head_id)
        assert stats["node_id"] == drafter_node.node_id, (stats["node_id"], drafter_node.node_id)

        timings = {}
        started = time.monotonic()
        before = [ask(p, draft_deadline_s=5) for p in PROMPTS[:2]]  # a loaded machine still drafts
        timings["before_s"] = round(time.monotonic() - started, 2)
        for prompt, reply in zip(PROMPTS[:2], before, strict=True):
            assert reply["choices"][0]["message"]["content"] == expected[prompt], (prompt, reply)
        drafted_before = [reply["taps"]["drafted_steps"] for reply in before]
        assert all(drafted_before), f"the remote drafter drafted no step: {drafted_before}"

        started = time.monotonic()
        during: dict[str, dict] = {}
        threads = [threading.Thread(target=lambda p=p: during.__setitem__(p, ask(p))) for p in PROMPTS[2:]]
        for thread in threads:
            thread.start()
        verifier = serve.get_deployment_handle(VERIFIER_DEPLOYMENT, app)
        for _ in range(100):  # remove the node once the requests are decoding
            if verifier.info.remote().result(timeout_s=60)["active"]:
                break
            time.sleep(0.1)
        cluster.remove_node(drafter_node)
        for thread in threads:
            thread.join(timeout=180)
        timings["during_s"] = round(time.monotonic() - started, 2)
        assert set(during) == set(PROMPTS[2:]), during
        for prompt, reply in during.items():
            assert reply["choices"][0]["message"]["content"] == expected[prompt], (prompt, reply)

        started = time.monotonic()
        after = {p: ask(p) for p in PROMPTS[::2]}
        timings["after_s"] = round(time.monotonic() - started, 2)
        for prompt, reply in after.items():
            assert reply["choices"][0]["message"]["content"] == expected[prompt], (prompt, reply)
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        return {"storage": shared, "verifier_node": info["node_id"], "drafter_node": stats["node_id"], "alive_after": alive,
                "drafted_before": drafted_before, "skipped_during": {p: r["taps"]["skipped"] for p, r in during.items()},
                "skipped_after": {p: r["taps"]["skipped"] for p, r in after.items()}, **timings}


def training(tmp: str) -> dict:
    """One variant, 2 Train workers, one on each of two nodes (2 CPUs each: 2 of the head's 5 CPUs are
    held by a placeholder actor at the start, so each node fits one worker and the head keeps a CPU for
    Train's controller); once a mid-run checkpoint
    exists the worker node is removed and the placeholder released: Ray Train restarts the worker group
    on the head alone from that checkpoint (``FailureConfig``), and the run ends with every step trained
    and logged once. Steps are slowed (``$TAPS_TRAIN_STEP_DELAY_S``) so the removal lands mid-run.

    The node is removed once Train has registered a checkpoint (its ``checkpoint_manager_snapshot.json``):
    removed as soon as the checkpoint folder appeared, the restart found no checkpoint and began again
    at step 1. Run by ``tests/test_multinode.py``, and by hand: ``python -m tests.multinode training DIR``."""
    import os
    from pathlib import Path

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from taps_ray.config import load_config
    from taps_ray.runstate import read_jsonl
    from taps_ray.train.launch import run_training
    from tests.train.train_helpers import tiny_experiment

    tmp_path = Path(tmp)
    os.environ["TAPS_CACHE"] = str(tmp_path / "cache")
    os.environ["TAPS_TRAIN_STEP_DELAY_S"] = "1.0"  # inherited by the raylets' workers
    variant = {"name": "a", "algorithm": "eagle2", "mixture": "math-only",
               "train": {"num_workers": 2, "checkpoint_every": 2, "log_every": 1, "epochs": 2}}
    path, target = tiny_experiment(tmp_path, [variant])
    cfg = load_config(path)
    checkpoints = cfg.run_dir / "ray" / "a"
    with two_node_cluster({"num_cpus": 5}, {"num_cpus": 2}) as (cluster, worker_node):
        head_id = ray.get_runtime_context().get_node_id()
        hold = ray.remote(num_cpus=2)(_Placeholder).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(head_id, soft=False)).remote()
        ray.get(hold.ready.remote())
        summary: list = []
        runner = threading.Thread(target=lambda: summary.append(run_training(cfg, target=target)))
        runner.start()
        deadline = time.monotonic() + 240
        snapshot = checkpoints / "checkpoint_manager_snapshot.json"  # written once Train registers a checkpoint
        while not snapshot.is_file():
            assert runner.is_alive() and time.monotonic() < deadline, "no checkpoint before the end"
            time.sleep(0.1)
        workers = _train_worker_nodes()
        assert sorted(workers) == sorted([head_id, worker_node.node_id]), (workers, head_id, worker_node.node_id)
        cluster.remove_node(worker_node)
        ray.kill(hold)
        removed_at = time.monotonic()
        runner.join(timeout=300)
        assert summary, "training did not end"
        result = summary[0].variants[0]
        assert result.status == "ok", result.error
        meta = json.loads((cfg.run_dir / "drafters" / "a" / "config.json").read_text())["training"]
        records = read_jsonl(cfg.run_dir / "drafters" / "a" / "metrics.jsonl")
    steps = [r["step"] for r in records if r["kind"] == "train"]
    total = meta["step"]
    assert meta["final"] and total == 6, meta  # 24 rows / 2 workers / batch 4 = 3 steps per epoch, 2 epochs
    starts = [a["start_step"] for a in meta["attempts"]]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] in (2, 3, 4), starts  # resumed off a checkpoint
    assert steps == list(range(1, total + 1)), f"a step was lost or logged twice: {steps}"
    return {"worker_nodes_before": workers, "head": head_id, "removed": worker_node.node_id, "starts": starts,
            "steps": steps, "resume_s": round(time.monotonic() - removed_at, 1)}


class _Placeholder:
    def ready(self) -> bool:
        return True


def _train_worker_nodes() -> list[str]:
    """The nodes of the bundles of the created placement groups (Ray Train's worker group is the one
    placement group here), by ``ray.util.placement_group_table`` (no dashboard needed)."""
    from ray.util import placement_group_table

    return sorted(node for pg in placement_group_table().values() if pg.get("state") == "CREATED"
                  for node in pg.get("bundles_to_node_id", {}).values())


SCENARIOS = {"serving": serving, "training": training}


def main(argv: list[str]) -> int:
    name, tmp = argv[1], argv[2]
    result = SCENARIOS[name](tmp)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

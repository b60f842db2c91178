"""The resources one sweep trial holds, planned against the cluster before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from taps_ray.sweeps.config import MixtureSweepSpec, SweepError, SweepSpec


@dataclass
class TrialResources:
    """Resources one trial holds at its peak, and how many trials run at once."""

    use_gpu: bool
    actor: dict[str, float]
    cpus: float
    gpus: float
    reserve_cpus: float
    max_concurrent: int
    describe: str



def _fmt(resources: dict[str, float]) -> str:
    return " + ".join(f"{v:g} {k}" for k, v in resources.items() if v) or "nothing"


def plan_resources(spec: SweepSpec, cluster: dict[str, float], nodes: list[dict[str, float]]) -> TrialResources:
    """Per-trial resources of ``spec`` on a cluster with ``cluster`` totals and ``nodes`` (each
    node's resources); SweepError when one trial cannot fit."""
    res = spec.resources
    have_cpu, have_gpu = float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0))
    if res.use_gpu is True and have_gpu < 1:
        raise SweepError("resources.use_gpu is true but the cluster has no GPUs (ray.cluster_resources() "
                         f"= {_fmt({'CPU': have_cpu, 'GPU': have_gpu})}); set resources.use_gpu: auto or false")
    use_gpu = have_gpu >= 1 if res.use_gpu == "auto" else bool(res.use_gpu)
    gpu = 1.0 if use_gpu else 0.0
    evaluation = {"CPU": res.eval_cpus, "GPU": gpu}
    if isinstance(spec, MixtureSweepSpec):
        worker = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": res.cpus_per_worker}
        actor = {"CPU": res.trial_cpus}
        train_cpu = res.num_workers * worker["CPU"]
        cpus = res.trial_cpus + max(train_cpu, res.eval_cpus)
        gpus = max(res.num_workers * worker.get("GPU", 0.0), gpu)
        reserve = res.reserve_cpus
        bundles = {"a Ray Train worker": worker, "the evaluation task": evaluation}
        describe = (f"the trial actor ({res.trial_cpus:g} CPU) + max({res.num_workers} Ray Train worker(s) x "
                    f"{_fmt(worker)}, evaluation {_fmt(evaluation)})" + (f"; {reserve:g} CPU kept free" if reserve else ""))
    else:
        actor = evaluation
        cpus, gpus, reserve = res.eval_cpus, gpu, 0.0
        bundles = {"the trial actor": evaluation}
        describe = f"one actor of {_fmt(evaluation)} (resources.eval_cpus, resources.use_gpu)"
    if cpus + reserve > have_cpu + 1e-9 or gpus > have_gpu + 1e-9:
        raise SweepError(
            f"sweep {spec.name!r}: each trial needs {cpus + reserve:g} CPU and {gpus:g} GPU ({describe}), but the "
            f"cluster has {have_cpu:g} CPU and {have_gpu:g} GPU (ray.cluster_resources()); lower "
            f"resources.num_workers / cpus_per_worker / eval_cpus / use_gpu, or add nodes")
    for what, bundle in bundles.items():
        if nodes and not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items() if v) for node in nodes):
            raise SweepError(f"sweep {spec.name!r}: {what} needs {_fmt(bundle)} on one node, but no node has that much "
                             f"(largest: {_fmt(max(nodes, key=lambda n: (n.get('GPU', 0), n.get('CPU', 0))))})")
    fits = [math.floor((have_cpu - reserve) / cpus + 1e-9)]
    if gpus:
        fits.append(math.floor(have_gpu / gpus + 1e-9))
    if res.max_concurrent_trials:
        fits.append(res.max_concurrent_trials)
    return TrialResources(use_gpu, actor, cpus, gpus, reserve, max(1, min(fits)), describe)


def cluster_resources() -> tuple[dict[str, float], list[dict[str, float]]]:
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    return dict(ray.cluster_resources()), nodes

"""Mixture sweep trials: train one drafter on a math:chat mixture with Ray Train and measure tau.

A trial is a Tune function trainable (Train V2 interop): it selects its mixture from the cached
features (:func:`~taps_ray.data.mixtures.select_mixture` via :func:`~taps_ray.train.variant.plan_variants`,
features are never recomputed), builds the variant's ``TorchTrainer`` with
:func:`~taps_ray.train.variant.build_trainer` and fits it. Every epoch but the last, the workers'
held-out simulated tau per dataset reaches Tune through :class:`EpochReport` as ``sim_tau/<domain>``
and ``sim_objective`` (the spec's objective over them), which the ASHA scheduler compares to stop
weak mixtures early. The final drafter is copied to ``<out>/trials/<trial_id>/drafter`` and a Ray
task (``eval_cpus``, + 1 GPU with ``use_gpu``) measures tau per domain on the held-out prompts with
the core decoder; the trial reports those, the objective and the final simulated tau.

A trial that fails is retried by Tune; its Ray Train run (``<out>/trials/<trial_id>/ray``) resumes
from its last checkpoint.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from ray.tune.integration.ray_train import TuneReportCallback

from taps_ray.config import ExperimentConfig, MixtureConfig, VariantConfig
from taps_ray.data.feature_sets import FeatureSet
from taps_ray.sweeps.config import MixtureSweepSpec, ObjectiveSpec
from taps_ray.sweeps.trial import TrialContext, evaluate_checkpoint

MIXTURE = "sweep"
VARIANT = "drafter"


@dataclass(kw_only=True)
class MixtureContext(TrialContext):
    """Everything a mixture trial needs, resolved on the driver, beyond what every trial needs.

    ``weights`` / ``heldout``: ObjectRefs of the target's embedding + LM head and of the held-out feature
    rows (shared by all trials); ``sim_datasets``: domain -> feature set whose held-out simulated tau
    stands for it; the feature sets and the target's sizes, config and fingerprint the trainer needs.
    """

    spec: MixtureSweepSpec
    cfg: ExperimentConfig
    sets: dict[str, FeatureSet]
    vocab_size: int
    eos_ids: frozenset[int]
    target_config: Any
    fingerprint: dict
    weights: Any
    heldout: Any
    sim_datasets: dict[str, str]
    use_gpu: bool


def trial_variant(spec: MixtureSweepSpec, cfg: ExperimentConfig, config: dict, use_gpu: bool = False
                  ) -> tuple[ExperimentConfig, VariantConfig]:
    """The experiment with mixture ``sweep`` and the single variant ``drafter`` of a trial's ``config``."""
    base = spec.mixture
    ratio = float(config.get("ratio", base.ratio))
    first, second = base.datasets
    mixture = MixtureConfig(ratio={first: ratio, second: 1.0 - ratio}, total=config.get("total", base.total),
                            seed=base.seed)
    train = {**base.train, **{k.split(".", 1)[1]: v for k, v in config.items() if k.startswith("train.")},
             "num_workers": spec.resources.num_workers, "use_gpu": use_gpu}
    objective = {**base.objective, **{k.split(".", 1)[1]: v for k, v in config.items() if k.startswith("objective.")}}
    variant = VariantConfig(name=VARIANT, algorithm=config.get("algorithm", base.algorithm), mixture=MIXTURE,
                            objective=objective, train=train)
    cfg.variant_train(variant)
    updated = cfg.model_copy(update={"mixtures": {**cfg.mixtures, MIXTURE: mixture}, "variants": [variant]})
    return updated, variant


def simulated(metrics: dict, sim_datasets: dict[str, str], objective: ObjectiveSpec) -> dict[str, float]:
    """``sim_tau/<domain>`` (held-out simulated tau of the domain's dataset) and ``sim_objective``."""
    taus = {d: float(metrics.get(f"heldout/{name}/tau", math.nan)) for d, name in sim_datasets.items()}
    return {**{f"sim_tau/{d}": t for d, t in taus.items()}, "sim_objective": objective.value(taus)}


class EpochReport(TuneReportCallback):
    """Forwards the end-of-epoch reports of the Train workers (all epochs but the last) to the Tune
    trial as ``epoch``, ``step``, ``loss``, ``sim_tau/<domain>`` and ``sim_objective``."""

    def __init__(self, sim_datasets: dict[str, str], objective: ObjectiveSpec, epochs: int):
        super().__init__()
        self.sim_datasets, self.objective, self.epochs = sim_datasets, objective, epochs

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        first = metrics[0]
        if not any(k.startswith("heldout/") for k in first) or first.get("done") or first.get("epoch", 0) >= self.epochs:
            return
        shaped = {"epoch": first["epoch"], "step": first.get("step"), "loss": first.get("loss"),
                  **simulated(first, self.sim_datasets, self.objective)}
        super().after_report(run_context, [shaped], None)


def mixture_trial(config: dict, context: MixtureContext) -> None:
    """One Tune trial: mixture, Ray Train fit, tau on held-out prompts, report (see module docstring)."""
    import ray
    from ray import tune
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from taps_ray.models.target import TargetFingerprint
    from taps_ray.train.variant import build_trainer, copy_final, init_vocabularies, plan_variants

    started = time.time()
    folder, attempt = context.begin(config)
    spec = context.spec
    cfg, variant = trial_variant(spec, context.cfg, config, context.use_gpu)
    init_vocab = init_vocabularies(cfg, [variant], context.target_config, TargetFingerprint(**context.fingerprint))
    plan = plan_variants(cfg, [variant], context.sets, context.vocab_size, context.eos_ids, init_vocab)[0]
    epochs = plan.train.epochs + (plan.train.stage2.epochs if plan.train.stage2 else 0)
    trainer = build_trainer(cfg, plan, folder, context.sets, context.weights, context.heldout, context.target_config,
                            context.fingerprint, context.use_gpu, spec.resources.cpus_per_worker, context.threads,
                            callbacks=[EpochReport(context.sim_datasets, spec.objective, epochs)])
    fitted = trainer.fit()
    drafter_dir = folder / "drafter"
    drafter_dir.mkdir(parents=True, exist_ok=True)
    copy_final(fitted.checkpoint, drafter_dir)
    final_sim = simulated(fitted.metrics or {}, context.sim_datasets, spec.objective)
    evaluate = ray.remote(evaluate_checkpoint).options(
        num_cpus=spec.resources.eval_cpus, num_gpus=1 if context.use_gpu else 0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None))
    threads = spec.resources.threads or max(1, int(spec.resources.eval_cpus))
    metrics = ray.get(evaluate.remote(context.target, str(drafter_dir), context.prompts,
                                      context.tree, spec.eval.max_new_tokens, threads))
    taus = {d: metrics[f"tau/{d}"] for d in spec.domains}
    tune.report({
        "epoch": epochs,
        **final_sim,
        **metrics,
        "objective": spec.objective.value(taus),
        "mixture": plan.selection.describe(),
        "rows": plan.rows,
        "tokens": plan.tokens,
        "steps": int((fitted.metrics or {}).get("step", 0)),
        "loss": (fitted.metrics or {}).get("loss"),
        "drafter": str(drafter_dir),
        "attempt": attempt,
        "wall_s": time.time() - started,
        "evaluated": True,
    })

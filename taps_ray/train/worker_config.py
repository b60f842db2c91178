"""What each Ray Train worker of one drafter variant is given: :class:`WorkerConfig`, built by
:func:`taps_ray.train.variant.build_trainer` and read by :func:`taps_ray.train.loop.train_loop_per_worker`
(Ray Train hands it over as ``train_loop_config={"worker": WorkerConfig(...)}``, its one key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from taps_ray.config import ObjectiveConfig, TrainConfig
from taps_ray.train.shards import FeatureBlock


@dataclass(frozen=True)
class WorkerConfig:
    """One variant's training run, as every worker of its group sees it."""

    variant: str                                  # the variant's name (logs, metrics, fault injection)
    objective: ObjectiveConfig                    # its loss: algorithm and weights
    train: TrainConfig                            # its training settings, the variant's overrides applied
    target_config: Any                            # the target's HF config (the drafter's shapes)
    fingerprint: dict[str, Any]                   # the target's TargetFingerprint fields
    weights: Any                                  # {"embed": [V, H], "lm_head": [V, H]}, or an ObjectRef of it
    blocks: list[FeatureBlock]                    # the training rows' blocks, in sequence order
    train_rows: int                               # rows of the training mixture
    datasets: list[str] = field(default_factory=list)   # the mixture's dataset names
    heldout: Any = None                           # {dataset: pyarrow Table} of held-out rows, or an ObjectRef
    draft_to_target: list[int] | None = None      # the reduced draft vocabulary (target ids); None: the whole
    drafter_seed: int = 0                         # seed of a freshly initialised drafter
    init_from: str | None = None                  # a drafter folder or release:NAME a fresh run starts from
    cache_rows: bool = False                      # keep the shard's rows in memory after the first epoch
    metrics_path: str | None = None               # rank 0 appends metrics.jsonl here
    threads: int | None = None                    # torch threads per worker (None: torch's default)
    fail_at_step: str | None = None               # fault injection (taps_ray.runtime.faults), drills and tests
    trained_prompts: dict | None = None           # written beside the drafter as trained_prompts.json
    meta: dict[str, Any] = field(default_factory=dict)  # written into the drafter's config.json

"""Ray Train worker loop of one drafter variant: ``TorchTrainer(train_loop_per_worker, ...)``.

``train_loop_config={"worker": WorkerConfig}`` (:class:`~taps_ray.train.worker_config.WorkerConfig`, built by
:func:`taps_ray.train.variant.build_trainer`): the variant, its objective and training settings, the target's
frozen tensors and config, the training rows' blocks, the held-out rows, and what is written beside the drafter.

Data (:mod:`taps_ray.train.shards`, :mod:`taps_ray.train.batches`): each worker reads its slice of
the training rows from their Parquet files once per epoch (or once, ``cache_rows``), in a seeded
order, and runs the same number of steps per epoch. Each rank evaluates every ``world``-th
held-out batch and the sums are all-reduced. The input-feature noise of a step is drawn from a generator seeded with (seed, rank,
step), so it needs no saved state and a resumed run draws exactly what an uninterrupted one would.

Checkpoints (rank 0; every ``checkpoint_every`` steps and at each epoch end, after the held-out
evaluation): ``drafter/`` (HF layout, :meth:`DraftHead.save`, plus ``trained_prompts.json``) and
``train_state.pt`` (optimizer,
step, tokens, attempts, last held-out metrics; the learning rate is a function of the step). A restart resumes at the checkpoint's step; the batches of the current
epoch before it are regenerated in the same seeded order and skipped without decoding, so no step
is trained twice and the final step count is unchanged. Rank 0 appends ``metrics.jsonl`` and cuts
it back to the resumed step on start.

Failure injection (tests, :mod:`taps_ray.runtime.faults`): ``fail_at_step`` or ``$TAPS_TRAIN_FAIL_AT_STEP`` =
``N`` (every variant) or ``variant:N[,variant:N]`` raises before step ``N`` once per rank (a marker
file next to ``metrics_path`` records that it happened).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from taps_ray.config import ObjectiveConfig, TrainConfig
from taps_ray.data.contamination import write_trained_prompts
from taps_ray.models.drafter import DrafterLoadError, DraftHead, drafter_class
from taps_ray.models.target import TargetFingerprint
from taps_ray.runstate import append_jsonl, read_jsonl, write_jsonl
from taps_ray.runtime import faults
from taps_ray.train.batches import collate, epoch_batches, heldout_rows, steps_per_epoch
from taps_ray.train.losses import drafter_loss, unwrap
from taps_ray.train.metrics import simulated_tau, unrolled_counts
from taps_ray.train.schedule import Stage, lr_at, plan_stages, stage_of
from taps_ray.train.shards import ShardRows
from taps_ray.train.worker_config import WorkerConfig

STATE_NAME = "train_state.pt"
DRAFTER_DIR = "drafter"
LOSS_PARTS = ("loss", "feature", "ce", "topk")


def loss_parts(algorithm: str) -> list[str]:
    """The loss parts :func:`~taps_ray.train.losses.drafter_loss` reports for ``algorithm``: topk for hass
    only, no feature term for eagle3."""
    return [p for p in LOSS_PARTS if (p != "topk" or algorithm == "hass") and (p != "feature" or algorithm != "eagle3")]


class MetricsLog:
    """``metrics.jsonl`` of one variant (rank 0): one JSON object per line, each with ``step``; the same
    numbers as TensorBoard scalars (``<kind>/<name>``, x = step) in ``tensorboard/`` beside it.

    A resumed run truncates both to its checkpoint's step (TensorBoard through ``purge_step``), so
    replayed steps are not shown twice."""

    SKIP = ("kind", "step", "epoch", "time")

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self._writer = None
        self._purge_step: int | None = None

    def truncate(self, step: int) -> None:
        """Drop records after ``step`` (a resumed run replays from there)."""
        self._purge_step = step + 1
        if self.path is None or not self.path.exists():
            return
        write_jsonl(self.path, [r for r in read_jsonl(self.path) if r["step"] <= step])

    def append(self, record: dict) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(self.path, [record], default=float)
        writer = self._tensorboard()
        for name, value in record.items():
            if name not in self.SKIP and isinstance(value, int | float) and math.isfinite(value):
                writer.add_scalar(f"{record.get('kind', 'metrics')}/{name}", value, record["step"])
        writer.flush()

    def _tensorboard(self):
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(self.path.parent / "tensorboard"), purge_step=self._purge_step)
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@dataclass
class TrainState:
    """Progress saved in every checkpoint."""

    step: int = 0
    tokens: int = 0
    train_seconds: float = 0.0
    cpu_seconds: float = 0.0
    last_eval_epoch: int = -1
    attempts: list[dict] = field(default_factory=list)
    heldout: dict = field(default_factory=dict)


def _all_reduce(values: list[float], device: torch.device, world: int) -> list[float]:
    if world == 1:
        return values
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


@torch.no_grad()
def evaluate(module: DraftHead, heldout: dict[str, list[dict]], embed: torch.Tensor, head: torch.Tensor,
             objective: ObjectiveConfig, depth: int, batch_size: int, hidden_size: int, pooled: list[str],
             device: torch.device, rank: int = 0, world: int = 1) -> dict[str, float]:
    """Held-out metrics per dataset and pooled over ``pooled`` datasets.

    Keys ``heldout/<dataset>/{loss,feature,ce[,topk],acc<k>,tau}`` and ``heldout/{...}`` (pooled):
    loss parts (no noise) are means over scored positions, ``acc<k>`` the greedy unrolled top-1
    accuracy at draft position k = 1..``depth``, ``tau`` the simulated acceptance length.
    """
    parts = loss_parts(objective.algorithm)
    sums: dict[str, list[float]] = {}
    for name in sorted(heldout):
        acc = [0.0] * (len(parts) + 1 + 2 * depth)
        for start in range(rank * batch_size, len(heldout[name]), world * batch_size):
            batch = {k: v.to(device) for k, v in collate(heldout[name][start:start + batch_size], hidden_size,
                                                         layers=module.row_layers).items()}
            out = drafter_loss(module, batch, embed, head, objective, add_noise=False)
            correct, total = unrolled_counts(module, batch, embed, head, depth)
            for i, part in enumerate(parts):
                acc[i] += out.parts[part] * out.tokens
            acc[len(parts)] += out.tokens
            for k in range(depth):
                acc[len(parts) + 1 + k] += correct[k]
                acc[len(parts) + 1 + depth + k] += total[k]
        sums[name] = _all_reduce(acc, device, world)
    metrics: dict[str, float] = {}
    groups = {f"heldout/{name}": [name] for name in sums}
    groups["heldout"] = [n for n in pooled if n in sums]
    for prefix, names in groups.items():
        if not names:
            continue
        total = [sum(sums[n][i] for n in names) for i in range(len(parts) + 1 + 2 * depth)]
        tokens = total[len(parts)]
        for i, part in enumerate(parts):
            metrics[f"{prefix}/{part}"] = total[i] / tokens if tokens else float("nan")
        accs = [c / t if t else float("nan") for c, t in
                zip(total[len(parts) + 1:len(parts) + 1 + depth], total[len(parts) + 1 + depth:])]
        for k, a in enumerate(accs, start=1):
            metrics[f"{prefix}/acc{k}"] = a
        metrics[f"{prefix}/tau"] = simulated_tau([0.0 if math.isnan(a) else a for a in accs])
    return metrics


def _resolve(value):
    import ray

    return ray.get(value) if isinstance(value, ray.ObjectRef) else value


def _target_weights(config: WorkerConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    weights = _resolve(config.weights)
    return weights["embed"].to(device), weights["lm_head"].to(device)


def _save_checkpoint(directory: Path, module: DraftHead, optimizer: torch.optim.Optimizer, state: TrainState,
                     fingerprint: TargetFingerprint, extra: dict, prompts: dict | None = None) -> None:
    module.save(directory / DRAFTER_DIR, fingerprint, extra=extra)
    if prompts is not None:
        write_trained_prompts(directory / DRAFTER_DIR, prompts)
    torch.save({"optimizer": optimizer.state_dict(), "state": asdict(state)}, directory / STATE_NAME)


def noise_seed(seed: int, rank: int, step: int) -> int:
    """Seed of the feature noise of ``step`` on ``rank``."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _quiet_report_logs() -> None:
    """Silence Ray Train's per-report INFO line (it prints every metric; its logger is named after
    the module file, so ``LoggingConfig`` does not reach it)."""
    import logging

    from taps_ray.runtime.ray_compat import train_report_logger_name

    logging.getLogger(train_report_logger_name()).setLevel(logging.WARNING)


@dataclass
class _Worker:
    """What one worker's loop holds: its place in the group, the run's settings, the drafter (``model``:
    as Ray Train wrapped it; ``module``: the DraftHead inside), its optimizer and progress, the frozen
    target tensors, the data, and the metrics window since the last train log line."""

    config: WorkerConfig
    rank: int
    world: int
    variant: str
    train: TrainConfig
    objective: ObjectiveConfig
    device: torch.device
    embed: torch.Tensor
    head: torch.Tensor
    fingerprint: TargetFingerprint
    metrics_log: MetricsLog
    state: TrainState
    module: DraftHead
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    stages: list[Stage]
    per_epoch: int
    fail_at: int | None
    marker: Path
    autocast: object
    heldout: dict[str, list[dict]]
    pooled: list[str]
    shard: ShardRows
    window: dict = field(default_factory=lambda: dict(_EMPTY_WINDOW))
    last: dict[str, float] = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return int(self.embed.shape[1])

    @property
    def total_epochs(self) -> int:
        return sum(s.epochs for s in self.stages)

    @property
    def total_steps(self) -> int:
        return self.total_epochs * self.per_epoch

    def log(self, line: str) -> None:
        if self.rank == 0:
            sys.stdout.write(f"[{self.variant}] {line}\n")
            sys.stdout.flush()

    def extra(self, final: bool) -> dict:
        """The drafter's ``config.json`` metadata: the run's settings, its progress, its held-out metrics."""
        state = self.state
        return {**self.config.meta, "name": self.variant, "algorithm": self.objective.algorithm,
                "objective": self.objective.model_dump(), "train": self.train.model_dump(),
                "training": {"step": state.step, "total_steps": self.total_steps, "epochs": self.total_epochs,
                             "tokens": state.tokens, "train_seconds": round(state.train_seconds, 2),
                             "cpu_seconds": round(state.cpu_seconds, 2),
                             "attempts": state.attempts, "final": final},
                "metrics": state.heldout}

    def report(self, metrics: dict, final: bool = False) -> None:
        """``ray.train.report`` of ``metrics``, with a checkpoint from rank 0."""
        import ray.train  # the worker's Ray Train context: only inside a Ray Train worker

        state = self.state
        metrics = {"variant": self.variant, "step": state.step, "total_steps": self.total_steps,
                   "tokens": state.tokens, "train_seconds": state.train_seconds, "cpu_seconds": state.cpu_seconds,
                   "attempt": len(state.attempts), "done": final, **metrics}
        if self.rank != 0:
            ray.train.report(metrics, checkpoint=None)
            return
        with tempfile.TemporaryDirectory() as directory:
            _save_checkpoint(Path(directory), self.module, self.optimizer, state, self.fingerprint, self.extra(final),
                             self.config.trained_prompts)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                             checkpoint_dir_name=f"checkpoint_step{state.step:07d}")


_EMPTY_WINDOW = {"loss": 0.0, "acc1": 0.0, "steps": 0, "tokens": 0, "seconds": 0.0}


def train_loop_per_worker(config: dict) -> dict:
    """Train one drafter variant on this worker's shard (see module docstring); ``config``: Ray Train's
    ``train_loop_config``, ``{"worker": WorkerConfig}``. Returns the final metrics on rank 0.

    The loop: :func:`_setup` (the drafter and optimizer, fresh or from the checkpoint), then per
    epoch one :func:`_train_step` per batch (:func:`_train_epoch` skips the steps a resumed run
    already trained and logs and checkpoints between steps), then :func:`_end_epoch` (held-out
    evaluation, the epoch's checkpoint)."""
    _quiet_report_logs()
    worker = _setup(config["worker"])
    if worker.state.step:
        worker.log(f"resumed at step {worker.state.step}/{worker.total_steps} (attempt {len(worker.state.attempts)})")
    for epoch in range(worker.state.step // worker.per_epoch, worker.total_epochs):
        objective = _stage_objective(worker, epoch)
        _train_epoch(worker, epoch, objective)
        _end_epoch(worker, epoch, objective)
    worker.metrics_log.close()
    return {"step": worker.state.step, **worker.state.heldout} if worker.rank == 0 else {}


def _setup(config: WorkerConfig) -> _Worker:
    """The worker's :class:`_Worker`: the drafter from the last checkpoint (with its optimizer and
    progress), else from ``init_from`` (its weights and vocabulary) or freshly initialised, wrapped by Ray Train; the data shard and held-out rows."""
    import ray.train  # the worker's Ray Train context: only inside a Ray Train worker
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    variant, train, objective = config.variant, config.train, config.objective
    if config.threads:
        torch.set_num_threads(config.threads)
    device = ray.train.torch.get_device()
    embed, head = _target_weights(config, device)
    hidden_size = int(embed.shape[1])
    fingerprint = TargetFingerprint(**config.fingerprint)
    metrics_log = MetricsLog(config.metrics_path if rank == 0 else None)

    state, saved = TrainState(), None
    checkpoint = ray.train.get_checkpoint()
    head_cls = drafter_class(objective.algorithm)
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            module = head_cls.load(Path(directory) / DRAFTER_DIR, config.target_config, fingerprint)
            saved = torch.load(Path(directory) / STATE_NAME, map_location="cpu", weights_only=True)
        state = TrainState(**saved["state"])
    elif config.init_from:
        module = head_cls.load(config.init_from, config.target_config, fingerprint)
        if type(module) is not head_cls:
            raise DrafterLoadError(f"variant {variant!r} trains {objective.algorithm} ({head_cls.architecture}); "
                                   f"train.init_from {config.init_from!r} is a {module.architecture} drafter")
    else:
        d2t = config.draft_to_target
        module = head_cls(config.target_config, draft_to_target=None if d2t is None else torch.tensor(d2t),
                          seed=config.drafter_seed)
    module.metadata = {}
    model = ray.train.torch.prepare_model(module.train())
    module = unwrap(model)
    optimizer = torch.optim.AdamW(module.parameters(), lr=train.lr, betas=(0.9, 0.95),
                                  weight_decay=train.weight_decay)
    generator = torch.Generator(device=device)
    if saved is not None:
        optimizer.load_state_dict(saved["optimizer"])
    metrics_log.truncate(state.step)
    state.attempts.append({"start_step": state.step, "time": time.time()})

    return _Worker(
        config=config, rank=rank, world=world, variant=variant, train=train, objective=objective, device=device,
        embed=embed, head=head, fingerprint=fingerprint, metrics_log=metrics_log, state=state, module=module,
        model=model, optimizer=optimizer, generator=generator, stages=plan_stages(train, objective.algorithm),
        per_epoch=steps_per_epoch(config.train_rows, world, train.batch_size),
        fail_at=faults.fail_at_step(config.fail_at_step or os.environ.get(faults.TRAIN_ENV), variant),
        marker=Path(config.metrics_path or tempfile.gettempdir()).with_name(f".injected_failure.rank{rank}"),
        autocast=torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext(),
        heldout=heldout_rows(_resolve(config.heldout), hidden_size, module.row_layers),
        pooled=list(config.datasets),
        shard=ShardRows(config.blocks, rank, world, config.cache_rows))


def _stage_objective(worker: _Worker, epoch: int) -> ObjectiveConfig:
    """The objective of ``epoch``'s stage (its ``topk_weight`` when the stage sets one)."""
    stage = stage_of(worker.stages, epoch)
    if stage.topk_weight is None:
        return worker.objective
    return worker.objective.model_copy(update={"topk_weight": stage.topk_weight})


def _train_epoch(worker: _Worker, epoch: int, objective: ObjectiveConfig) -> None:
    """The steps of ``epoch``: its batches in their seeded order, those a resumed run already trained
    skipped undecoded; a train log line every ``log_every`` steps, a checkpoint every ``checkpoint_every``."""
    state, train, per_epoch = worker.state, worker.train, worker.per_epoch
    skip = state.step - epoch * per_epoch
    batches = epoch_batches(worker.shard, train.batch_size, train.shuffle_buffer, train.seed, epoch, worker.rank)
    for index, rows in enumerate(batches):
        if index >= per_epoch:
            break
        if index < skip:
            continue
        faults.train_step_fault(worker.fail_at, state.step + 1, worker.marker, worker.variant)
        faults.train_step_delay()
        lr, grad_norm = _train_step(worker, rows, epoch, objective)
        epoch_end = index + 1 == per_epoch
        if state.step % train.log_every == 0 or epoch_end:
            _log_window(worker, epoch, lr, grad_norm)
        if state.step % train.checkpoint_every == 0 and not epoch_end:
            worker.report({"epoch": epoch + 1, **worker.last})


def _train_step(worker: _Worker, rows: list[dict], epoch: int, objective: ObjectiveConfig) -> tuple[float, float]:
    """One optimizer step on ``rows`` at the scheduled learning rate, with the step's seeded feature
    noise; progress and the metrics window updated. Returns (lr, grad norm)."""
    state, train, window = worker.state, worker.train, worker.window
    stage = stage_of(worker.stages, epoch)
    started, cpu_started = time.perf_counter(), time.process_time()
    batch = {k: v.to(worker.device, non_blocking=True) for k, v in
             collate(rows, worker.hidden_size, train.max_tokens, layers=worker.module.row_layers).items()}
    lr = lr_at(state.step - stage.first_epoch * worker.per_epoch, stage.epochs * worker.per_epoch, stage.lr,
               train.warmup_steps, train.schedule)
    for group in worker.optimizer.param_groups:
        group["lr"] = lr
    worker.generator.manual_seed(noise_seed(train.seed, worker.rank, state.step))
    with worker.autocast:
        out = drafter_loss(worker.model, batch, worker.embed, worker.head, objective, generator=worker.generator)
    worker.optimizer.zero_grad(set_to_none=True)
    out.total.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(worker.module.parameters(), train.grad_clip))
    worker.optimizer.step()
    tokens = int(batch["attention_mask"].sum())
    state.step += 1
    state.tokens += tokens
    seconds = time.perf_counter() - started
    state.train_seconds += seconds
    state.cpu_seconds += time.process_time() - cpu_started
    window["seconds"] += seconds
    window["loss"] += out.parts["loss"]
    window["acc1"] += out.top1_acc[0] if not math.isnan(out.top1_acc[0]) else 0.0
    window["steps"] += 1
    window["tokens"] += tokens
    return lr, grad_norm


def _log_window(worker: _Worker, epoch: int, lr: float, grad_norm: float) -> None:
    """The train metrics since the last log line: into ``metrics.jsonl`` and ``last``, one line printed."""
    window, state = worker.window, worker.state
    worker.last = last = {"loss": window["loss"] / window["steps"], "train_acc1": window["acc1"] / window["steps"],
                          "lr": lr, "grad_norm": grad_norm,
                          "tokens_per_s": window["tokens"] / max(window["seconds"], 1e-9)}
    worker.metrics_log.append({"kind": "train", "step": state.step, "epoch": epoch + 1, "time": time.time(), **last})
    worker.log(f"step {state.step}/{worker.total_steps} epoch {epoch + 1}/{worker.total_epochs} loss "
               f"{last['loss']:.4f} acc1 {last['train_acc1']:.3f} lr {lr:.2e} {last['tokens_per_s']:.0f} tok/s")
    worker.window = dict(_EMPTY_WINDOW)


def _end_epoch(worker: _Worker, epoch: int, objective: ObjectiveConfig) -> None:
    """Evaluate on the held-out rows (once per epoch, also across restarts), then report the epoch with
    its checkpoint (the final one after the last epoch)."""
    state, train = worker.state, worker.train
    if state.last_eval_epoch < epoch:
        worker.module.eval()
        with worker.autocast:
            state.heldout = evaluate(worker.module, worker.heldout, worker.embed, worker.head, objective,
                                     train.eval_depth, train.batch_size, worker.hidden_size, worker.pooled,
                                     worker.device, worker.rank, worker.world)
        worker.module.train()
        state.last_eval_epoch = epoch
        worker.metrics_log.append({"kind": "eval", "step": state.step, "epoch": epoch + 1, "time": time.time(),
                                   **state.heldout})
        worker.log(f"epoch {epoch + 1}/{worker.total_epochs} held-out " + " | ".join(
            f"{name}: acc " + "/".join(f"{state.heldout[f'heldout/{name}/acc{k}']:.2f}"
                                       for k in range(1, train.eval_depth + 1))
            + f" tau {state.heldout[f'heldout/{name}/tau']:.2f}"
            for name in sorted(worker.heldout)))
    worker.report({"epoch": epoch + 1, **worker.last, **state.heldout}, final=epoch + 1 == worker.total_epochs)

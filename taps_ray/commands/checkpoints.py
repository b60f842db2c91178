"""``taps`` subcommands that write drafter checkpoints: average (weight space) and export (EAGLE format)."""

from __future__ import annotations

import argparse
from pathlib import Path

from taps_ray.commands.common import UserError, config_args, load_drafters, load_experiment


def add_average(parser: argparse.ArgumentParser) -> None:
    config_args(parser)
    parser.add_argument("--drafter", action="append", default=[], metavar="DIR", help="drafter checkpoint (2 or more)")
    parser.add_argument("--alpha", type=float, default=None, help="two drafters: alpha * first + (1 - alpha) * second")
    parser.add_argument("--weights", default=None, help="comma-separated weights, one per drafter, summing to 1")
    parser.add_argument("--out", required=True, help="folder of the averaged checkpoint")


def run_average(args: argparse.Namespace) -> int:
    """Average drafter checkpoints in weight space."""
    from taps_ray.data.contamination import write_averaged
    from taps_ray.drafter_sources import random_drafter_seed, resolve_drafter_dir
    from taps_ray.models.drafter import average_drafters, is_drafter_checkpoint
    from taps_ray.models.target import TargetModel
    from taps_ray.spec.compose import averaging_weights
    from taps_ray.spec.strategy import StrategySpec

    if len(args.drafter) < 2:
        raise UserError(f"give at least two --drafter folders, got {len(args.drafter)}")
    if args.alpha is not None and args.weights is not None:
        raise UserError("give --alpha or --weights, not both")
    if args.alpha is not None and not 0.0 <= args.alpha <= 1.0:
        raise UserError(f"--alpha must be in [0, 1], got {args.alpha}")
    try:
        given = [float(w) for w in args.weights.split(",")] if args.weights else None
    except ValueError:
        raise UserError(f"--weights must be comma-separated numbers, got {args.weights!r}") from None
    weights = averaging_weights(StrategySpec("averaged", alpha=args.alpha), len(args.drafter), given)
    out = Path(args.out)
    inputs = [Path(resolve_drafter_dir(d)).resolve() for d in args.drafter if random_drafter_seed(d) is None]
    if out.resolve() in inputs:
        raise UserError(f"--out {out} is one of the --drafter inputs; averaging into it would replace that drafter "
                        "and its trained-prompt list (the contamination guard): choose another folder")
    if out.exists() and not is_drafter_checkpoint(out) and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not a drafter checkpoint; refusing to replace it (choose "
                        "another folder)")
    cfg = load_experiment(args)
    target = TargetModel.load(cfg.target)
    heads = load_drafters(target, args.drafter, cfg.drafter.seed)
    merged = average_drafters(heads, weights)
    merged.metadata.update(name=Path(args.out).name, averaged_from=[str(Path(d).resolve()) for d in args.drafter])
    path = merged.save(args.out, target.fingerprint)
    write_averaged(path, args.drafter)  # the union of the parts' trained prompts (contamination guard)
    print(f"wrote {path}: " + " + ".join(f"{w:g} * {d}" for w, d in zip(weights, args.drafter)))
    return 0


def add_export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", metavar="DRAFTER", help="drafter checkpoint folder or release:NAME")
    parser.add_argument("--format", required=True, choices=["eagle", "eagle3"],
                        help="eagle: an EAGLE-1/EAGLE-2 folder (SafeAILab layout) for an eagle2/hass drafter; eagle3: "
                             "an EAGLE-3 folder (SpecForge / SafeAILab EAGLE-3 layout) for an eagle3 drafter")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (an earlier export there is replaced)")
    parser.add_argument("--engine", choices=["sglang", "vllm"], default="sglang",
                        help="the engine the folder is for (default: %(default)s; its layout is also SafeAILab "
                             "EAGLE's and SpecForge's): they differ in the architecture name, in how they treat "
                             "fc.bias (eagle) and in how they count the fused target layers (eagle3)")
    parser.add_argument("--drop-fc-bias", action="store_true",
                        help="eagle only: write the drafter without its fc bias (needed for vLLM, whose EAGLE head "
                             "has none; outputs stay exact, acceptance may drop)")
    parser.add_argument("--target", default=None, metavar="MODEL",
                        help="eagle3 only: the target whose LM head rows the folder carries (default: the one the "
                             "drafter records, e.g. embedded:smollm2-135m); it must match the drafter's fingerprint")


def run_export(args: argparse.Namespace) -> int:
    """Write a drafter as an EAGLE-2 or EAGLE-3 folder for vLLM or SGLang."""
    from taps_ray.models.drafter import DrafterLoadError
    from taps_ray.models.eagle_format import export_eagle, load_taps_drafter

    try:
        head, fingerprint, source = load_taps_drafter(args.drafter)
    except DrafterLoadError as err:
        raise UserError(str(err)) from err
    if Path(args.out).resolve() == source.resolve():
        raise UserError(f"--out {args.out!r} is the drafter's own folder; choose another")
    wanted = "eagle3" if head.algorithm == "eagle3" else "eagle"
    if args.format != wanted:
        raise UserError(f"--format {args.format} does not fit this {head.algorithm} drafter: use --format {wanted}")
    if args.format == "eagle3":
        return _export_eagle3(args, head, fingerprint, source)
    if args.target is not None:
        raise UserError("--target is for --format eagle3 (an EAGLE-1/EAGLE-2 folder carries no LM head)")
    done = export_eagle(head, args.out, fingerprint, engine=args.engine, drop_fc_bias=args.drop_fc_bias,
                        source=source)
    print(f"wrote {done.path} (EAGLE-1/EAGLE-2 for {done.engine}, bias: {str(done.bias).lower()}"
          + (", fc.bias dropped" if done.fc_bias_dropped else "") + ")")
    if done.engine == "vllm":
        print(f"""  vLLM: LLM(model=..., speculative_config={{"method": "eagle", "model": "{done.path}", """
              f""""num_speculative_tokens": 5}})""")
    else:
        token_map = f" --speculative-token-map {done.token_map}" if done.token_map else ""
        print(f"  SGLang: --speculative-algorithm EAGLE --speculative-draft-model-path {done.path}{token_map}")
    return 0


def _export_eagle3(args: argparse.Namespace, head, fingerprint, source: Path) -> int:
    """``taps export --format eagle3``: the folder carries the target's LM head rows, so the target is loaded."""
    from taps_ray.config import TargetConfig
    from taps_ray.models.eagle3_format import export_eagle3
    from taps_ray.models.target import TargetModel

    if args.drop_fc_bias:
        raise UserError("--drop-fc-bias is for --format eagle (an EAGLE-3 fc has no bias)")
    model = args.target or fingerprint.name
    target = TargetModel.load(TargetConfig(model=model, device="cpu", dtype="float32"))
    if problem := target.fingerprint.mismatch(fingerprint):
        raise UserError(f"--target {model!r} is not the drafter's target: {problem}")
    done = export_eagle3(head, args.out, fingerprint, target.lm_head.weight, engine=args.engine, source=source)
    print(f"wrote {done.path} (EAGLE-3 for {done.engine}, fused target layers {done.aux_layer_ids} as "
          f"{done.engine} counts them)")
    if done.engine == "vllm":
        print(f"""  vLLM: LLM(model=..., speculative_config={{"method": "eagle3", "model": "{done.path}", """
              f""""num_speculative_tokens": 5}})""")
    else:
        print(f"  SGLang: --speculative-algorithm EAGLE3 --speculative-draft-model-path {done.path}")
    return 0

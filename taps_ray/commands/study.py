"""``taps`` subcommands of the study, which read an experiment config and write its run folder: demo,
prepare, train, adapt, eval, report and sweep, and config-help, the config's reference."""

from __future__ import annotations

import argparse
import json
import sys

from taps_ray.commands.common import UserError, config_args, load_experiment
from taps_ray.config import load_config


def add_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="configs/demo.yaml", help="experiment YAML (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.limit=5")
    parser.add_argument("--full", action="store_true", help="the larger run (`make demo DEMO=full`): more training, "
                                                            "larger evaluation limits, into runs/demo-full")
    parser.add_argument("--no-sweep", action="store_true", help="skip the interpolation sweep")


def run_demo(args: argparse.Namespace) -> int:
    """The whole study on one config: prepare, train, eval, interpolation sweep, report."""
    from taps_ray import demo

    demo.run_demo(args.config, args.overrides, full=args.full, sweep=not args.no_sweep)
    return 0


def add_prepare(parser: argparse.ArgumentParser) -> None:
    config_args(parser)
    parser.add_argument("--datasets", default=None, help="comma-separated dataset names (default: all)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run_prepare(args: argparse.Namespace) -> int:
    """Compute and cache target features for the config's datasets."""
    from taps_ray.data.features import prepare_features, summary_table

    cfg = load_experiment(args)
    names = args.datasets.split(",") if args.datasets else None
    results = prepare_features(cfg, names)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        print(summary_table(results))
    return 0


def add_train(parser: argparse.ArgumentParser) -> None:
    config_args(parser)
    parser.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue existing variants from their last checkpoint")
    mode.add_argument("--force", action="store_true", help="delete existing variant outputs and retrain")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run_train(args: argparse.Namespace) -> int:
    """Train drafter variants concurrently with Ray Train."""
    from taps_ray.train.launch import run_training, summary_table

    cfg = load_experiment(args)
    names = [n.strip() for n in args.variants.split(",") if n.strip()] if args.variants else None
    summary = run_training(cfg, names, mode="resume" if args.resume else "force" if args.force else "new")
    print(json.dumps(summary.to_dict(), indent=1, default=float) if args.json else summary_table(summary))
    return 1 if summary.failed else 0


def add_adapt(parser: argparse.ArgumentParser) -> None:
    config_args(parser)
    parser.add_argument("--traffic", default=None, metavar="DIR",
                        help="a serving capture folder (serve.capture.dir) of this config's target (with --watch: "
                             "default serve.capture's folder)")
    parser.add_argument("--traffic-share", type=float, default=None, metavar="SHARE",
                        help="share of training rows from the traffic, in [0, 1] (default: adapt.traffic_share)")
    parser.add_argument("--drafter", default=None, metavar="SRC",
                        help="drafter folder or release:NAME to fine-tune (with --new: the baseline of the tau); with "
                             "--watch: the serve.drafters name to adapt and promote into (default adapt.drafter)")
    parser.add_argument("--new", action="store_true", help="train a new specialist on the traffic only")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="also copy the new version there (default: <run folder>/drafters/adapt-vN only)")
    parser.add_argument("--watch", action="store_true",
                        help="beside a running taps serve (RAY_ADDRESS, or as a Ray job): every adapt.every captured "
                             "requests adapt the serving version, promote it if it passes the gate (adapt.margin, "
                             "adapt.min_gain), log it to <run folder>/adapt/promotions.jsonl; until Ctrl-C or "
                             "adapt.rounds")
    parser.add_argument("--json", action="store_true", help="print the version's adapt record as JSON")


def run_adapt(args: argparse.Namespace) -> int:
    """Fine-tune a drafter on captured serving traffic mixed with its original data (a new version); --watch:
    adapt and promote continuously beside taps serve."""
    from taps_ray.adapt.finetune import run_adapt as adapt
    from taps_ray.adapt.promote import PromotionError

    cfg = load_experiment(args)
    if args.watch:
        if args.new or args.out or args.traffic_share is not None:
            raise UserError("--watch fine-tunes the serving version at adapt.traffic_share into the run folder; "
                            "--new, --out and --traffic-share do not apply (set adapt.traffic_share)")
        return _watch(cfg, args)
    if args.traffic is None or args.drafter is None:
        raise UserError("--traffic DIR and --drafter SRC are required (or --watch beside a running taps serve)")
    try:
        result = adapt(cfg, args.traffic, args.drafter, args.traffic_share, args.new, args.out)
    except PromotionError as err:
        raise UserError(str(err)) from None
    if args.json:
        print(json.dumps({"out": str(result.out), "version": result.version, **result.record}, indent=1))
    else:
        print(f"version {result.version} -> {result.out} ({result.record['traffic_rows']} traffic rows)")
        for name, tau in result.record["tau"].items():
            print(f"  tau {name}: {tau['before']:.3f} -> {tau['after']:.3f}")
    return 0


def _watch(cfg, args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from taps_ray.adapt.promote import PromotionError
    from taps_ray.adapt.watch import watch

    try:
        done = watch(cfg, args.traffic, args.drafter)
    except KeyboardInterrupt:
        return 0
    except PromotionError as err:
        raise UserError(str(err)) from None
    for entry in done:
        if args.json:
            print(json.dumps(asdict(entry)))
        else:
            verdict = "promoted" if entry.promoted else "kept aside"
            print(f"version {entry.version} ({entry.checkpoint}): {verdict}: {entry.reason}")
    return 0


def add_eval(parser: argparse.ArgumentParser) -> None:
    config_args(parser)
    parser.add_argument("--benchmarks", default=None, help="comma-separated subset of mt_bench,gsm8k,math_500,svamp")
    parser.add_argument("--strategies", default=None,
                        help="comma-separated strategy names, e.g. single,averaged,routed:confidence,merged:budget "
                             "(vanilla always runs, for the speedup)")
    parser.add_argument("--temperatures", default=None, help="comma-separated, e.g. 0,1")
    parser.add_argument("--limit", type=int, default=None, help="questions per benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per turn")
    parser.add_argument("--drafters", default=None, metavar="NAME=DIR,...",
                        help="drafter roles, e.g. math=runs/demo/drafters/hass-math,chat=runs/demo/drafters/hass-chat "
                             "(DIR may be random:SEED for an untrained drafter)")
    parser.add_argument("--compose", default=None, metavar="NAME,...",
                        help="the drafters averaged / routed / merged strategies combine, in order (default with "
                             "--drafters: all of them; else the config's eval.compose)")
    parser.add_argument("--alphas", default=None, help="alpha grid of averaged:ALPHA runs, e.g. 0,0.25,0.5,0.75,1")
    parser.add_argument("--actors", type=int, default=None, help="Ray actors (0: run in this process)")
    parser.add_argument("--out", default=None, help="run folder (default: <output_dir>/<name>/eval)")


def eval_overrides(args: argparse.Namespace) -> list[str]:
    def items(text: str) -> list[str]:
        return [v.strip() for v in text.split(",") if v.strip()]

    def floats(text: str, flag: str) -> list[float]:
        try:
            return [float(v) for v in items(text)]
        except ValueError:
            raise UserError(f"{flag} must be comma-separated numbers, got {text!r}") from None

    given = {"benchmarks": args.benchmarks and items(args.benchmarks),
             "strategies": args.strategies and items(args.strategies),
             "temperatures": args.temperatures and floats(args.temperatures, "--temperatures"),
             "alphas": args.alphas and floats(args.alphas, "--alphas"),
             "limit": args.limit, "max_new_tokens": args.max_new_tokens, "num_actors": args.actors}
    if args.drafters:
        pairs = [item.split("=", 1) for item in items(args.drafters)]
        if any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
            raise UserError(f"--drafters must look like NAME=DIR,NAME=DIR, got {args.drafters!r}")
        given["drafters"] = dict(pairs)
    overrides = [f"eval.{k}={json.dumps(v)}" for k, v in given.items() if v is not None]
    if args.compose:
        overrides.append(f"eval.compose={json.dumps(items(args.compose))}")
    elif args.drafters:
        overrides.append("eval.compose=null")
    return overrides


def run_eval(args: argparse.Namespace) -> int:
    """Benchmarks x strategies x temperatures on Ray actors, then the report."""
    from taps_ray.eval import runner
    from taps_ray.eval.records import read_records
    from taps_ray.eval.report import build_tables, markdown_table

    cfg = load_config(args.config, list(args.overrides) + eval_overrides(args))
    out = runner.run_eval(cfg, args.out)
    tables, data = build_tables(read_records(out))
    for t in data.temperatures:
        rows = [r for r in tables["speed"] if r["temperature"] == t]
        print(f"T={t:g}\n" + markdown_table(rows, ["strategy", "questions", "tau", "tokens_per_s", "speedup", "tree_size"]))
    print(f"wrote {out / 'report.md'}", file=sys.stderr)
    return 0


def add_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="an evaluation run folder (holds records.jsonl)")
    parser.add_argument("--sweep", action="append", default=None, metavar="DIR",
                        help="include a `taps sweep` output folder's results and plot (repeatable; remembered)")


def run_report(args: argparse.Namespace) -> int:
    """Regenerate an evaluation run's report from its records."""
    from taps_ray.eval.report import write_report

    print(write_report(args.dir, args.sweep))
    return 0


def add_sweep(parser: argparse.ArgumentParser) -> None:
    from taps_ray.sweeps.run import add_arguments

    add_arguments(parser)


def run_sweep(args: argparse.Namespace) -> int:
    """Ray Tune sweep over data-mixture ratios or checkpoint-interpolation weights (tune/*.yaml)."""
    from taps_ray.sweeps.run import run_command

    return run_command(args)


def add_config_help(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("key", nargs="?", default=None,
                        help="only this dotted key and the keys under it, e.g. serve or tree.depth")
    parser.add_argument("--sweep", action="store_true", help="the keys of sweep specs (tune/*.yaml)")
    parser.add_argument("--markdown", action="store_true",
                        help="the whole reference as Markdown (`taps config-help --markdown > docs/CONFIG.md`)")


def run_config_help(args: argparse.Namespace) -> int:
    """Every config key with its type, default and description (docs/CONFIG.md)."""
    from taps_ray.config_doc import documents, render_markdown, render_text, select

    if args.markdown:
        if args.key or args.sweep:
            raise UserError("--markdown writes the whole reference; it takes no KEY or --sweep")
        sys.stdout.write(render_markdown())
        return 0
    parts = documents()
    keys = [k for _, _, part in (parts[1:] if args.sweep else parts[:1]) for k in part]
    shown = select(keys, args.key)
    if not shown:
        top = sorted({k.key.split(".")[0].split("[")[0] for k in keys})
        raise UserError(f"no key {args.key!r}; top-level keys: {', '.join(top)}")
    sys.stdout.write(render_text(shown))
    return 0

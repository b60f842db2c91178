"""``taps``: one subcommand per job.

Each subcommand is a ``(add_arguments, run)`` pair registered in :data:`COMMANDS`; ``run`` gets
the parsed namespace and returns a process exit code. Errors that are the user's (bad config,
bad value, missing file) print one clear line and exit 2, never a traceback. Each ``run`` imports
what its job needs inside it, so ``taps --help`` and the light commands load neither torch nor Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from taps_ray.config import ConfigError, load_config
from taps_ray.runstate import RunStateError

log = logging.getLogger("taps")


class UserError(Exception):
    """An error caused by the command line or its inputs; printed without a traceback."""


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML, e.g. configs/demo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.features.max_len=512 "
                                                     "(`taps config-help` lists every key)")


def _load(args: argparse.Namespace):
    return load_config(args.config, args.overrides)


# -- prepare -------------------------------------------------------------------------------------

def _add_prepare(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--datasets", default=None, help="comma-separated dataset names (default: all)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _run_prepare(args: argparse.Namespace) -> int:
    from taps_ray.data.features import prepare_features, summary_table

    cfg = _load(args)
    names = args.datasets.split(",") if args.datasets else None
    results = prepare_features(cfg, names)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        print(summary_table(results))
    return 0


# -- generate ------------------------------------------------------------------------------------

def _add_generate(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--prompt", required=True, help="user message (the target's chat template is applied)")
    parser.add_argument("--drafter", action="append", default=[], metavar="DIR",
                        help="drafter checkpoint directory (repeatable; 'single' uses the first)")
    parser.add_argument("--strategy", default="single",
                        help="vanilla, single, averaged[:ALPHA], routed:confidence[:step|:request], "
                             "routed:entropy[:step|:request], merged:union, merged:budget (K >= 2 via --drafter)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: config sampling)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _drafters(target, dirs: list[str], seed: int) -> list:
    from taps_ray.models.drafter import DrafterLoadError
    from taps_ray.models.release import default_release_drafter
    from taps_ray.spec.decoder import load_drafter

    if not dirs:
        shipped = default_release_drafter("math")
        if shipped is None:
            print("taps: no --drafter given: using a freshly initialised (untrained) drafter", file=sys.stderr)
            return [load_drafter(target, None, seed)]
        print(f"taps: no --drafter given: using {shipped}", file=sys.stderr)
        dirs = [shipped]
    try:
        return [load_drafter(target, d) for d in dirs]
    except DrafterLoadError as err:
        raise UserError(str(err)) from err


def _run_generate(args: argparse.Namespace) -> int:
    from taps_ray.models.target import TargetModel
    from taps_ray.spec.compose import build_strategy
    from taps_ray.spec.decoder import check_sampling, generate

    cfg = _load(args)
    given = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    sampling = check_sampling({**cfg.sampling.model_dump(), **{k: v for k, v in given.items() if v is not None}})
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise UserError("--prompt is empty")
    target = TargetModel.load(cfg.target)
    drafters = _drafters(target, args.drafter, cfg.drafter.seed) if args.strategy != "vanilla" else []
    result = generate(target, args.prompt, build_strategy(args.strategy, drafters, cfg.tree), sampling,
                      args.max_new_tokens)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(result.text)
        print(f"[{result.strategy}] {len(result.token_ids)} tokens, {len(result.steps)} steps, "
              f"tau {result.tau:.2f}, {result.tokens_per_s:.1f} tok/s", file=sys.stderr)
    return 0


# -- bench ---------------------------------------------------------------------------------------

def _add_bench(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--drafter", default=None, metavar="DIR",
                        help="drafter checkpoint folder or release:NAME (default: release:math when shipped, "
                             "else untrained)")
    parser.add_argument("--benchmark", default="gsm8k", help="mt_bench, gsm8k, math_500 or svamp")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--no-exactness", action="store_true",
                        help="skip the float32 reference that measures divergences in reduced precision")
    parser.add_argument("--limit", type=int, default=4, help="number of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="output folder (default: <output_dir>/<name>/bench)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate baselines")
    parser.add_argument("--sweep", action="store_true", help="also sweep tree total_tokens x depth")
    parser.add_argument("--sweep-total", default="4,8,16,32", help="total_tokens values of the sweep")
    parser.add_argument("--sweep-depth", default="1,2,4", help="depth values of the sweep")
    parser.add_argument("--sweep-lookup", default=None, help="lookup_tokens values of the sweep (default: the config's)")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise UserError(f"{flag} is empty")
    return values


def _run_bench(args: argparse.Namespace) -> int:
    import torch

    from taps_ray.config import TreeConfig
    from taps_ray.data.contamination import union_trained_prompts
    from taps_ray.eval.bench import benchmark_prompts, run_bench, write_report
    from taps_ray.models.release import default_release_drafter, resolve_drafter_dir
    from taps_ray.models.target import TargetModel
    from taps_ray.spec.decoder import check_sampling

    cfg = _load(args)
    if args.limit < 1 or args.max_new_tokens < 1:
        raise UserError(f"--limit and --max-new-tokens must be >= 1, got {args.limit} and {args.max_new_tokens}")
    totals = _int_list(args.sweep_total, "--sweep-total") if args.sweep else None
    depths = _int_list(args.sweep_depth, "--sweep-depth") if args.sweep else None
    lookups = _int_list(args.sweep_lookup, "--sweep-lookup") if args.sweep and args.sweep_lookup else None
    if totals:
        try:
            [TreeConfig(**{**cfg.tree.model_dump(), "depth": d, "total_tokens": n, "lookup_tokens": m})
             for d in depths for n in totals for m in (lookups or [cfg.tree.lookup_tokens])]
        except ValueError as err:
            raise UserError(f"invalid sweep values: {err}") from None
    try:
        sampling = check_sampling({"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed})
    except ValueError as err:
        raise UserError(str(err)) from None
    target = TargetModel.load(cfg.target)
    print(f"taps bench: target dtype {target.dtype_note}", file=sys.stderr)
    drafter_name = args.drafter or default_release_drafter("math")
    drafter = _drafters(target, [drafter_name] if drafter_name else [], cfg.drafter.seed)[0]
    reference = None
    if target.dtype != torch.float32 and sampling.temperature == 0 and not args.no_exactness:
        reference = TargetModel.load(cfg.target.model_copy(update={"dtype": "float32"}))
    seen = union_trained_prompts([resolve_drafter_dir(drafter_name)]) if drafter_name else set()
    prompts = benchmark_prompts(target, args.benchmark, args.limit, exclude=seen)
    if seen:
        print(f"taps bench: questions the drafter trained on are excluded ({len(seen)} training prompts known)",
              file=sys.stderr)
    report = run_bench(target, prompts, drafter, cfg.tree, args.max_new_tokens, hf=not args.no_hf,
                       sweep_total=totals, sweep_depth=depths, sweep_lookup=lookups, sampling=sampling, reference=reference,
                       settings={"benchmark": args.benchmark, "drafter": drafter_name or "untrained (fresh init)"})
    json_path, md_path = write_report(report, args.out or cfg.run_dir / "bench")
    print(report.to_markdown())
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


# -- train ---------------------------------------------------------------------------------------

def _add_train(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue existing variants from their last checkpoint")
    mode.add_argument("--force", action="store_true", help="delete existing variant outputs and retrain")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _run_train(args: argparse.Namespace) -> int:
    from taps_ray.train.launch import run_training, summary_table

    cfg = _load(args)
    names = [n.strip() for n in args.variants.split(",") if n.strip()] if args.variants else None
    summary = run_training(cfg, names, mode="resume" if args.resume else "force" if args.force else "new")
    print(json.dumps(summary.to_dict(), indent=1, default=float) if args.json else summary_table(summary))
    return 1 if summary.failed else 0


# -- eval / report / average ---------------------------------------------------------------------

def _add_eval(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
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


def _eval_overrides(args: argparse.Namespace) -> list[str]:
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


def _run_eval(args: argparse.Namespace) -> int:
    from taps_ray.eval.records import read_records
    from taps_ray.eval.report import build_tables, markdown_table
    from taps_ray.eval.runner import run_eval

    cfg = load_config(args.config, list(args.overrides) + _eval_overrides(args))
    out = run_eval(cfg, args.out)
    tables, data = build_tables(read_records(out))
    for t in data.temperatures:
        rows = [r for r in tables["speed"] if r["temperature"] == t]
        print(f"T={t:g}\n" + markdown_table(rows, ["strategy", "questions", "tau", "tokens_per_s", "speedup", "tree_size"]))
    print(f"wrote {out / 'report.md'}", file=sys.stderr)
    return 0


def _add_report(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="an evaluation run folder (holds records.jsonl)")
    parser.add_argument("--sweep", action="append", default=None, metavar="DIR",
                        help="include a `taps sweep` output folder's results and plot (repeatable; remembered)")


def _run_report(args: argparse.Namespace) -> int:
    from taps_ray.eval.report import write_report

    print(write_report(args.dir, args.sweep))
    return 0


def _add_average(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--drafter", action="append", default=[], metavar="DIR", help="drafter checkpoint (2 or more)")
    parser.add_argument("--alpha", type=float, default=None, help="two drafters: alpha * first + (1 - alpha) * second")
    parser.add_argument("--weights", default=None, help="comma-separated weights, one per drafter, summing to 1")
    parser.add_argument("--out", required=True, help="folder of the averaged checkpoint")


def _run_average(args: argparse.Namespace) -> int:
    from pathlib import Path

    from taps_ray.data.contamination import write_averaged
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
    if out.exists() and not is_drafter_checkpoint(out) and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not a drafter checkpoint; refusing to replace it (choose "
                        "another folder)")
    cfg = _load(args)
    target = TargetModel.load(cfg.target)
    heads = _drafters(target, args.drafter, cfg.drafter.seed)
    merged = average_drafters(heads, weights)
    merged.metadata.update(name=Path(args.out).name, averaged_from=[str(Path(d).resolve()) for d in args.drafter])
    path = merged.save(args.out, target.fingerprint)
    write_averaged(path, args.drafter)  # the union of the parts' trained prompts (contamination guard)
    print(f"wrote {path}: " + " + ".join(f"{w:g} * {d}" for w, d in zip(weights, args.drafter)))
    return 0


# -- export --------------------------------------------------------------------------------------

def _add_export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", metavar="DRAFTER", help="drafter checkpoint folder or release:NAME")
    parser.add_argument("--format", required=True, choices=["eagle"],
                        help="eagle: an EAGLE-1/EAGLE-2 folder (SafeAILab layout) that vLLM and SGLang load")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (an earlier export there is replaced)")
    parser.add_argument("--engine", choices=["sglang", "vllm"], default="sglang",
                        help="the engine the folder is for (default: %(default)s; its layout is also SafeAILab "
                             "EAGLE's): they differ in the architecture name and in how they treat fc.bias")
    parser.add_argument("--drop-fc-bias", action="store_true",
                        help="write the drafter without its fc bias (needed for vLLM, whose EAGLE head has none; "
                             "outputs stay exact, acceptance may drop)")


def _run_export(args: argparse.Namespace) -> int:
    from taps_ray.models.drafter import DrafterLoadError
    from taps_ray.models.eagle_format import export_eagle, load_taps_drafter

    try:
        head, fingerprint, source = load_taps_drafter(args.drafter)
    except DrafterLoadError as err:
        raise UserError(str(err)) from err
    if Path(args.out).resolve() == source.resolve():
        raise UserError(f"--out {args.out!r} is the drafter's own folder; choose another")
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


# -- serve ---------------------------------------------------------------------------------------

def _add_serve(parser: argparse.ArgumentParser) -> None:
    _config_args(parser)
    parser.add_argument("--host", default=None, help="bind address (default: serve.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default: serve.port, 8000)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="accept 'Authorization: Bearer KEY' (repeatable; adds to serve.api_keys and the "
                             "comma-separated TAPS_API_KEY env); without any key the endpoint is open")


def _run_serve(args: argparse.Namespace) -> int:
    from taps_ray.serving.app import run

    cfg = _load(args)
    if args.api_key:
        try:
            cfg.serve.api_keys = [*cfg.serve.api_keys, *args.api_key]
        except ValueError as err:
            raise UserError(f"--api-key: {err.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    if args.port is not None and not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    run(cfg, args.host, args.port)
    return 0


# -- sweep ---------------------------------------------------------------------------------------

def _add_sweep(parser: argparse.ArgumentParser) -> None:
    from taps_ray.sweeps.run import add_arguments

    add_arguments(parser)


def _run_sweep(args: argparse.Namespace) -> int:
    from taps_ray.sweeps.run import run_command

    return run_command(args)


# -- config-help ---------------------------------------------------------------------------------

def _add_config_help(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("key", nargs="?", default=None,
                        help="only this dotted key and the keys under it, e.g. serve or tree.depth")
    parser.add_argument("--sweep", action="store_true", help="the keys of sweep specs (tune/*.yaml)")
    parser.add_argument("--markdown", action="store_true",
                        help="the whole reference as Markdown (`taps config-help --markdown > docs/CONFIG.md`)")


def _run_config_help(args: argparse.Namespace) -> int:
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


# -- demo ----------------------------------------------------------------------------------------

def _add_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="configs/demo.yaml", help="experiment YAML (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.limit=5")
    parser.add_argument("--full", action="store_true", help="the larger run (`make demo DEMO=full`): more training, "
                                                            "larger evaluation limits, into runs/demo-full")
    parser.add_argument("--no-sweep", action="store_true", help="skip the interpolation sweep")


def _run_demo(args: argparse.Namespace) -> int:
    from taps_ray.demo import run_demo

    run_demo(args.config, args.overrides, full=args.full, sweep=not args.no_sweep)
    return 0


COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "demo": ("the whole study on one config: prepare, train, eval, interpolation sweep, report", _add_demo, _run_demo),
    "prepare": ("compute and cache target features for the config's datasets", _add_prepare, _run_prepare),
    "generate": ("generate a reply with plain or speculative decoding", _add_generate, _run_generate),
    "eval": ("benchmarks x strategies x temperatures on Ray actors, then the report", _add_eval, _run_eval),
    "report": ("regenerate an evaluation run's report from its records", _add_report, _run_report),
    "average": ("average drafter checkpoints in weight space", _add_average, _run_average),
    "export": ("write a drafter as an EAGLE-1/EAGLE-2 folder for vLLM or SGLang", _add_export, _run_export),
    "bench": ("decode speed: vanilla vs HF generate vs prompt lookup vs speculative", _add_bench, _run_bench),
    "train": ("train drafter variants concurrently with Ray Train", _add_train, _run_train),
    "serve": ("serve the target and drafters behind an OpenAI-compatible API (Ray Serve)", _add_serve, _run_serve),
    "config-help": ("every config key with its type, default and description (docs/CONFIG.md)",
                    _add_config_help, _run_config_help),
    "sweep": ("Ray Tune sweep over data-mixture ratios or checkpoint-interpolation weights (tune/*.yaml)",
              _add_sweep, _run_sweep),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="taps", description="Task-aware speculative decoding on Ray")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; dotted overrides (``key.path=value``) may also follow the flags."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _run_folder(args: argparse.Namespace) -> Path | None:
    """The run folder of a command that runs Ray (its Ray log goes to ``<run folder>/logs/ray.log``); None
    for the others, or when the config does not load (the command then reports why)."""
    try:
        if args.command == "demo":
            from taps_ray.demo import demo_config

            return demo_config(args.config, args.overrides, args.full).run_dir
        if args.command in ("prepare", "train", "eval"):
            return _load(args).run_dir
        if args.command == "sweep":
            from taps_ray.sweeps.config import load_spec

            config, overrides = args.config, list(args.overrides)
            if config is not None and "=" in config and not Path(config).exists():
                config, overrides = None, [config, *overrides]
            return load_config(config or load_spec(args.spec, args.preset, overrides).experiment).run_dir
    except Exception:  # noqa: BLE001  (the command itself reports a bad config)
        return None
    return None


def _shown(path: Path) -> str:
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Loading weights" bars, here and in actors
    import transformers

    transformers.utils.logging.disable_progress_bar()
    _, _, run = COMMANDS[args.command]
    ray_log = _route_ray_logs(args)
    try:
        return run(args)
    except (ConfigError, UserError, FileNotFoundError, ValueError, RunStateError) as err:
        print(f"taps {args.command}: error: {err}", file=sys.stderr)
        return 2
    finally:
        if ray_log is not None:
            _end_ray_log(args, ray_log)


def _route_ray_logs(args: argparse.Namespace) -> Path | None:
    """Ray's own messages to ``<run folder>/logs/ray.log`` for a command that runs Ray (see
    :func:`taps_ray.ray_utils.route_ray_logs`); the path, named on the console, or None."""
    run_folder = _run_folder(args)
    if run_folder is None:
        return None
    from taps_ray.ray_utils import ray_log_path, route_ray_logs

    try:
        path = route_ray_logs(ray_log_path(run_folder))
    except OSError:  # an unwritable output_dir: the command itself says so
        return None
    print(f"taps {args.command}: Ray's own messages go to {_shown(path)}", file=sys.stderr, flush=True)
    return path


def _end_ray_log(args: argparse.Namespace, path: Path) -> None:
    """Name the Ray log again when Ray ran; otherwise give Ray's loggers their console back."""
    import ray

    from taps_ray.ray_utils import stop_routing_ray_logs

    if ray.is_initialized():  # stays routed until exit: Ray's shutdown still writes
        print(f"taps {args.command}: Ray's log of this run: {_shown(path)}", file=sys.stderr, flush=True)
    else:
        stop_routing_ray_logs()


if __name__ == "__main__":
    sys.exit(main())

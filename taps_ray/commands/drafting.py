"""``taps`` subcommands that decode with a target and drafters: generate, bench and serve."""

from __future__ import annotations

import argparse
import json
import sys

from taps_ray.commands.common import UserError, config_args, int_list, load_drafters, load_experiment


def add_generate(parser: argparse.ArgumentParser) -> None:
    config_args(parser)
    parser.add_argument("--prompt", required=True, help="user message (the target's chat template is applied)")
    parser.add_argument("--drafter", action="append", default=[], metavar="DIR",
                        help="drafter checkpoint folder, release:NAME or random:SEED (repeatable; 'single' uses the first)")
    parser.add_argument("--strategy", default="single",
                        help="vanilla, single, averaged[:ALPHA], routed:confidence[:step|:request], "
                             "routed:entropy[:step|:request], merged:union, merged:budget (K >= 2 via --drafter)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop sequence (repeatable): the output ends before the first one generated")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: config sampling)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON object (else the text as it is decoded)")


class _Printer:
    """A step observer that writes the decoded text to stdout as the loop commits it."""

    def __init__(self):
        self.printed = 0

    def on_step(self, tokens: list[int], text: str) -> None:
        if text:
            print(text, end="", flush=True)
            self.printed += len(text)


def run_generate(args: argparse.Namespace) -> int:
    """Generate a reply with plain or speculative decoding."""
    from taps_ray.models.target import TargetModel
    from taps_ray.spec.compose import build_strategy
    from taps_ray.spec.decoder import check_sampling, generate

    cfg = load_experiment(args)
    given = {"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    sampling = check_sampling({**cfg.sampling.model_dump(), **{k: v for k, v in given.items() if v is not None}})
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise UserError("--prompt is empty")
    if not all(args.stop):
        raise UserError("--stop takes a non-empty text")
    target = TargetModel.load(cfg.target)
    drafters = load_drafters(target, args.drafter, cfg.drafter.seed) if args.strategy != "vanilla" else []
    printer = None if args.json else _Printer()
    result = generate(target, args.prompt, build_strategy(args.strategy, drafters, cfg.tree), sampling,
                      args.max_new_tokens, stop=args.stop or None, observer=printer)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print((result.text or "")[printer.printed:])
        print(f"[{result.strategy}, {result.finish_reason}] {len(result.token_ids)} tokens, {len(result.steps)} steps, "
              f"tau {result.tau:.2f}, {result.tokens_per_s:.1f} tok/s", file=sys.stderr)
    return 0


def add_calibrate(parser: argparse.ArgumentParser) -> None:
    config_args(parser)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, as decoding uses)")
    parser.add_argument("--json", action="store_true", help="print the cost model as one JSON object")


def run_calibrate(args: argparse.Namespace) -> int:
    """Measure the verification cost model of this machine, dtype, threads and engine (cached)."""
    import torch

    from taps_ray.models.target import TargetModel
    from taps_ray.spec.cost import cost_model, cost_path

    cfg = load_experiment(args)
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    target = TargetModel.load(cfg.target)
    model = cost_model(target, refresh=True)
    if args.json:
        print(json.dumps({**model.to_dict(), "path": str(cost_path(model.key))}))
        return 0
    key = model.key
    print(f"cost model of {cfg.target.model} on {key['hardware']} ({key['device']}, {key['dtype']}, "
          f"{key['threads']} threads, engine {key['engine']}, torch {key['torch']}), measured in {model.measured_s:.1f} s")
    if key.get("int4_max_rows") is not None:
        print(f"int4 weights: steps of up to {key['int4_max_rows']} tokens read the 4-bit codes, wider ones the "
              f"packed dense copy ({'pinned by target.int4_max_rows' if target.engine.int4_rows_pinned else 'measured on this machine'})")
    print("| nodes | verify ms | vs plain step |\n|---:|---:|---:|")
    for n, seconds, rel in zip(model.nodes, model.verify_s, model.relative().values()):
        print(f"| {n} | {1e3 * seconds:.1f} | {rel:.2f}x |")
    print(f"cached at {cost_path(key)} (every decode on this machine and setting reads it)")
    return 0


def add_bench(parser: argparse.ArgumentParser) -> None:
    config_args(parser)
    parser.add_argument("--drafter", default=None, metavar="DIR",
                        help="drafter checkpoint folder, release:NAME or random:SEED (untrained) (default: release:math when "
                             "shipped, else untrained)")
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
    parser.add_argument("--peer", action="append", default=[], choices=["llamacpp"],
                        help="also time a peer engine as a speed row (llamacpp: plain llama.cpp on the target's GGUF "
                             "with the same threads; needs the bench extra). Repeatable")
    parser.add_argument("--sweep", action="store_true", help="also sweep tree total_tokens x depth")
    parser.add_argument("--sweep-total", default="4,8,16,32", help="total_tokens values of the sweep")
    parser.add_argument("--sweep-depth", default="1,2,4", help="depth values of the sweep")
    parser.add_argument("--sweep-lookup", default=None, help="lookup_tokens values of the sweep (default: the config's)")


def _sweep_grid(args: argparse.Namespace, tree) -> tuple[list[int] | None, list[int] | None, list[int] | None]:
    """``taps bench --sweep``'s tree totals, depths and lookup lengths (None without --sweep), each
    combination checked as a TreeConfig over ``tree``."""
    from taps_ray.config import TreeConfig

    if not args.sweep:
        return None, None, None
    totals = int_list(args.sweep_total, "--sweep-total")
    depths = int_list(args.sweep_depth, "--sweep-depth")
    lookups = int_list(args.sweep_lookup, "--sweep-lookup") if args.sweep_lookup else None
    try:
        [TreeConfig(**{**tree.model_dump(), "depth": d, "total_tokens": n, "lookup_tokens": m})
         for d in depths for n in totals for m in (lookups or [tree.lookup_tokens])]
    except ValueError as err:
        raise UserError(f"invalid sweep values: {err}") from None
    return totals, depths, lookups


def _check_peer(target) -> None:
    """UserError unless llama-cpp-python is installed and ``target`` has a GGUF file for it."""
    from taps_ray.eval.peers import PeerError, gguf_file

    try:
        import llama_cpp  # noqa: F401

        gguf_file(target)
    except ImportError:
        raise UserError("--peer llamacpp needs llama-cpp-python: pip install -e '.[bench]' (it builds "
                        "llama.cpp with this machine's compiler)") from None
    except PeerError as err:
        raise UserError(str(err)) from None


def run_bench(args: argparse.Namespace) -> int:
    """Decode speed: vanilla vs HF generate vs prompt lookup vs speculative (and llama.cpp with --peer)."""
    from taps_ray.data.benchmarks import BENCHMARKS
    from taps_ray.data.contamination import union_trained_prompts
    from taps_ray.drafter_sources import default_release_drafter, resolve_drafter_dir
    from taps_ray.eval import bench
    from taps_ray.models.target import TargetModel
    from taps_ray.spec.decoder import check_sampling

    cfg = load_experiment(args)
    if args.limit < 1 or args.max_new_tokens < 1:
        raise UserError(f"--limit and --max-new-tokens must be >= 1, got {args.limit} and {args.max_new_tokens}")
    if args.benchmark not in BENCHMARKS:
        raise UserError(f"unknown benchmark {args.benchmark!r}; valid names: {', '.join(BENCHMARKS)}")
    totals, depths, lookups = _sweep_grid(args, cfg.tree)
    try:
        sampling = check_sampling({"temperature": args.temperature, "top_p": args.top_p, "seed": args.seed})
    except ValueError as err:
        raise UserError(str(err)) from None
    target = TargetModel.load(cfg.target)
    print(f"taps bench: target dtype {target.dtype_note}, weights {target.weights}", file=sys.stderr)
    if args.peer:
        _check_peer(target)
    drafter_name = args.drafter or default_release_drafter("math")
    drafter = load_drafters(target, [drafter_name] if drafter_name else [], cfg.drafter.seed)[0]
    reference = None
    if not target.exact_reference and sampling.temperature == 0 and not args.no_exactness:
        reference = TargetModel.load(cfg.target.model_copy(update={"dtype": "float32", "weights": "dense", "compile": False}))
    seen = union_trained_prompts([resolve_drafter_dir(drafter_name)]) if drafter_name else set()
    prompts = bench.benchmark_prompts(target, args.benchmark, args.limit, exclude=seen)
    if seen:
        print(f"taps bench: questions the drafter trained on are excluded ({len(seen)} training prompts known)",
              file=sys.stderr)
    from taps_ray.eval.peers import PeerError

    try:
        report = bench.run_bench(target, prompts, drafter, cfg.tree, args.max_new_tokens, hf=not args.no_hf,
                                 sweep_total=totals, sweep_depth=depths, sweep_lookup=lookups, sampling=sampling,
                                 reference=reference, peers=args.peer, settings={
                                     "benchmark": args.benchmark, "drafter": drafter_name or "untrained (fresh init)"})
    except PeerError as err:
        raise UserError(f"--peer: {err}") from None
    json_path, md_path = bench.write_report(report, args.out or cfg.run_dir / "bench")
    print(report.to_markdown())
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


def add_serve(parser: argparse.ArgumentParser) -> None:
    config_args(parser)
    parser.add_argument("--host", default=None, help="bind address (default: serve.http.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default: serve.http.port, 8000)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="accept 'Authorization: Bearer KEY' (repeatable; adds to serve.http.api_keys and the "
                             "comma-separated TAPS_API_KEY env); without any key only a loopback address is served "
                             "(serve.http.allow_unauthenticated=true opens another)")


def run_serve(args: argparse.Namespace) -> int:
    """Serve the target and drafters behind an OpenAI-compatible API (Ray Serve)."""
    from taps_ray.serving.app import run

    cfg = load_experiment(args)
    if args.api_key:
        try:
            cfg.serve.http.api_keys = [*cfg.serve.http.api_keys, *args.api_key]
        except ValueError as err:
            raise UserError(f"--api-key: {err.errors()[0]['msg'].removeprefix('Value error, ')}") from None
    if args.port is not None and not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    try:
        run(cfg, args.host, args.port)
    except ValueError as err:
        raise UserError(str(err)) from None
    return 0

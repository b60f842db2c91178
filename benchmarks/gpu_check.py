"""The decoding core on an accelerator, with no hub: a random-weight Llama target, both engines.

    python benchmarks/gpu_check.py                      # ~1B Llama, bf16 on CUDA (float32 on CPU)
    python benchmarks/gpu_check.py --size tiny --device cpu --dtype float32   # what the test suite runs

For each target engine (``static``: models/engine.py; ``static+graphs``: the same with its steps of up to 64
tokens replayed as CUDA graphs, models/graphs.py -- on a CPU the fixed-shape step those graphs capture,
run eagerly; ``hf``: transformers' forward) it checks that
greedy speculative decoding with an oracle drafter (the target's own continuation as a chain, with
decoy siblings) gives vanilla's tokens exactly, times vanilla against that oracle (the speedup a
perfect drafter would give on this device: the engine's ceiling), that random-weight EAGLE-2 and EAGLE-3 heads (real drafters, the EAGLE-3 one reading three target
layers' features) decode vanilla's tokens too, and measures the verification cost
of n tree nodes relative to one plain step, n = 1..64. Prints one JSON object (``--out`` writes it too);
graph capture seconds are reported apart (``capture_s``), outside every timing, which each take the fastest of
``--repeats`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from taps_ray.config import TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.models.eagle3 import Eagle3Head
from taps_ray.models.graphs import StepGraphs
from taps_ray.models.target import TargetModel
from taps_ray.models.target_loading import resolve_device_dtype
from taps_ray.spec.cost import measure
from taps_ray.spec.decoder import generate
from taps_ray.spec.protocol import DecodeState, SingleStrategy
from taps_ray.spec.tree import DraftTree, build_tree

SIZES = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}
NODES = (1, 2, 4, 8, 16, 32, 64)
ENGINES = ("static", "static+graphs", "hf")


def random_target(size: str, device: torch.device, dtype: torch.dtype, engine: str, seed: int = 0) -> TargetModel:
    """A random-weight Llama of ``size`` (:data:`SIZES`) on ``device`` in ``dtype``, its layers scaled so that
    greedy text varies (random init alone repeats one token), EOS never emitted (its LM-head row is zero)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**SIZES[size], bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.model.layers.parameters():
            if param.dim() == 2:
                param.mul_(8.0)
        model.lm_head.weight.normal_(0, 4.0 / config.hidden_size ** 0.5)
        model.lm_head.weight[1] = 0
    model.to(device=device, dtype=dtype)
    graphs = engine == "static+graphs"
    target = TargetModel(model, None, f"random-llama-{size}", engine=engine.removesuffix("+graphs"),
                         graphs="on" if graphs and device.type == "cuda" else "off")
    if graphs and device.type != "cuda":
        target.engine.graphs = StepGraphs(target.engine, capture=False)
    return target


class ChainOracle:
    """Proposes the target's own continuation ``reference`` (prompt + vanilla output) as a chain of ``depth``
    nodes, each with a decoy sibling, so a step accepts ``depth`` tokens unless the reference runs out."""

    name = "oracle"

    def __init__(self, reference: list[int], vocab_size: int, depth: int):
        self.reference, self.vocab_size, self.depth = reference, vocab_size, depth

    def start(self, target, tokens, features):
        pass

    def advance(self, tokens, features):
        pass

    def propose(self, state: DecodeState) -> DraftTree:
        length = state.tokens.numel()
        truth = self.reference[length:length + self.depth]
        rng = random.Random(length)
        tokens, parents = [int(state.tokens[-1])], [-1]
        for token in truth:
            chain_parent = len(tokens) - 1 if len(tokens) == 1 else len(tokens) - 2
            decoy = token
            while decoy == token:
                decoy = rng.randrange(2, self.vocab_size)
            tokens += [token, decoy]
            parents += [chain_parent, chain_parent]
        return build_tree(tokens, parents, prefix_len=state.prefix_len).to(state.tokens.device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(device: torch.device, call, repeats: int = 1) -> float:
    """The fastest of ``repeats`` timed calls."""
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def check_engine(target: TargetModel, prompt_len: int, new_tokens: int, depth: int, repeats: int = 3) -> dict:
    """Greedy vanilla against the chain oracle on one random prompt: exactness, tau, speeds."""
    prompt = torch.randint(2, target.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(1))
    generate(target, prompt, None, max_new_tokens=4, eos_token_ids=set())
    holder = {}

    def run_vanilla():
        holder["vanilla"] = generate(target, prompt, None, max_new_tokens=new_tokens, eos_token_ids=set())

    vanilla_s = _seconds(target.device, run_vanilla, repeats)
    vanilla = holder["vanilla"]
    oracle = ChainOracle(prompt.tolist() + vanilla.token_ids, target.vocab_size, depth)
    generate(target, prompt, oracle, max_new_tokens=4, eos_token_ids=set())

    def run_spec():
        holder["spec"] = generate(target, prompt, oracle, max_new_tokens=new_tokens, eos_token_ids=set())

    spec_s = _seconds(target.device, run_spec, repeats)
    spec = holder["spec"]
    heads = {}
    layers = target.config.num_hidden_layers
    aux = None if layers >= 5 else (0, layers // 2, layers - 1)  # the default aux layers need 5 (tiny has 2)
    for name, head in (("eagle2", DraftHead(target.config, seed=3)), ("eagle3", Eagle3Head(target.config, seed=3, aux=aux))):
        head = head.to(device=target.device, dtype=target.dtype).eval()
        strategy = SingleStrategy(head, TreeConfig(depth=3, top_k=4, total_tokens=16, lookup_tokens=0, adaptive=False))
        drafted = generate(target, prompt, strategy, max_new_tokens=min(new_tokens, 32), eos_token_ids=set())
        heads[name] = {"greedy_identical": drafted.token_ids == vanilla.token_ids[:len(drafted.token_ids)],
                       "tau": round(drafted.tau, 3)}
    diverged = next((i for i, (a, b) in enumerate(zip(spec.token_ids, vanilla.token_ids)) if a != b), None)
    return {"greedy_identical": spec.token_ids == vanilla.token_ids, "first_divergence": diverged,
            "tokens": len(vanilla.token_ids),
            "oracle_tau": round(spec.tau, 3), "vanilla_tok_s": round(len(vanilla.token_ids) / vanilla_s, 2),
            "oracle_tok_s": round(len(spec.token_ids) / spec_s, 2), "oracle_speedup": round(vanilla_s / spec_s, 3),
            "random_heads": heads}


def run(size: str = "1b", device: str = "auto", dtype: str = "auto", new_tokens: int = 64, prompt_len: int = 128,
        depth: int = 5, engines: tuple[str, ...] = ENGINES, nodes=NODES, repeats: int = 3) -> dict:
    """The whole check (see the module docstring) as a dict."""
    dev, dt = resolve_device_dtype(device, dtype)
    report = {"size": size, "device": str(dev), "dtype": str(dt).removeprefix("torch."), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
              "engines": {}}
    for engine in engines:
        start = time.perf_counter()
        target = random_target(size, dev, dt, engine)
        load_s = time.perf_counter() - start
        result = check_engine(target, prompt_len, new_tokens, depth, repeats)
        cost = measure(target, nodes, prefix=prompt_len)
        graphs = target.engine.graphs if target.engine is not None else None
        if graphs is not None:
            result["graphs"] = {"captured": graphs.capture, "captures": graphs.captures,
                                "capture_s": round(graphs.capture_s, 3)}
        result["verify_ms"] = {n: round(1e3 * s, 3) for n, s in zip(cost.nodes, cost.verify_s)}
        result["verify_cost_vs_plain"] = cost.relative()
        result["load_s"] = round(load_s, 2)
        report["engines"][engine] = result
        del target
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report["all_identical"] = all(r["greedy_identical"] and all(h["greedy_identical"] for h in r["random_heads"].values())
                                  for r in report["engines"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--depth", type=int, default=5, help="oracle chain length per step")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each decode (the fastest counts)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    engines = tuple(args.engines.split(","))
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {', '.join(ENGINES)}")
    report = run(args.size, args.device, args.dtype, args.new_tokens, args.prompt_len, args.depth, engines,
                 repeats=args.repeats)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if report["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

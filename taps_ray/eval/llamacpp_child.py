"""The llama.cpp peer's own process: loads a GGUF with ``llama-cpp-python`` and decodes prompts sent over a pipe.

A fault in llama.cpp's kernels must not take the benchmark with it: its AMX kernels die with SIGILL on
``tilezero`` in their worker threads on some AMX machines (ggml-org/llama.cpp#26954; seen on a 2-core Sapphire
Rapids VM, llama-cpp-python 0.3.36). :func:`serve` decodes a warm-up prompt of :data:`WARMUP_TOKENS` tokens
before it reports ready, so such a fault ends the child at load, and the parent can start another with
``extra_buffers=False`` (no AMX or repacked weight buffers: llama.cpp's AVX-512/AVX2 kernels). Nothing here
imports torch, so the two engines never share a thread pool either.

Protocol over ``conn`` (a :func:`multiprocessing.Pipe` end): the child first sends ``("ready", None)`` or
``("error", message)``; then for each ``list[int]`` of prompt ids it receives it sends
``("run", (tokens, wall_seconds, cpu_seconds))``; ``None`` ends it.
"""

from __future__ import annotations

import time

WARMUP_TOKENS = 64
"""Length of the warm-up prompt decoded before the child reports ready: long enough for llama.cpp's batched
(prompt) kernels, the AMX ones included."""


def _load(gguf: str, n_ctx: int, threads: int, extra_buffers: bool):
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama

    if not extra_buffers:  # llama-cpp-python has no argument for llama_model_params.use_extra_bufts
        defaults = bindings.llama_model_default_params

        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = without_extra_buffers
    return Llama(gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)


def _greedy(model, ids: list[int], max_new_tokens: int, stops: set[int]) -> list[int]:
    tokens: list[int] = []
    for token in model.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if token in stops or len(tokens) >= max_new_tokens:
            break
    return tokens


def serve(conn, gguf: str, n_ctx: int, threads: int, eos: list[int], max_new_tokens: int,
          extra_buffers: bool = True) -> None:
    """Decode greedily with llama.cpp on ``gguf`` every prompt received on ``conn`` until ``None``: at most
    ``max_new_tokens`` tokens, stopping after an EOS (kept), ``threads`` for both prompt and generation;
    ``extra_buffers``: llama.cpp's AMX / repacked weight buffers where it has them (its default)."""
    stops = set(eos)
    try:
        model = _load(gguf, n_ctx, threads, extra_buffers)
        warmup = min(WARMUP_TOKENS, n_ctx - 4)
        _greedy(model, [(37 * i) % model.n_vocab() for i in range(warmup)], 2, stops)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it as a PeerError
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))
    while (ids := conn.recv()) is not None:
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = _greedy(model, ids, max_new_tokens, stops)
        conn.send(("run", (tokens, time.perf_counter() - wall, time.process_time() - cpu)))

"""eval/peers.py: plain llama.cpp on the embedded target's own GGUF as a speed row of ``taps bench``."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import psutil
import pytest
import torch

from taps_ray.eval import llamacpp_child, peers
from taps_ray.eval.bench import run_bench
from taps_ray.eval.peers import PeerError, gguf_file, llamacpp, peer_method
from taps_ray.models.engine import Linear, can_pack
from tests.spec.spec_helpers import peaky_tiny_target


def test_a_target_without_a_gguf_has_no_llamacpp_peer():
    with pytest.raises(PeerError, match="needs a GGUF target"):
        gguf_file(peaky_tiny_target(0))
    with pytest.raises(PeerError, match="unknown peer 'vllm'; valid: llamacpp"):
        peer_method("vllm", peaky_tiny_target(0), 4)


@pytest.mark.slow
def test_llamacpp_decodes_the_embedded_gguf_greedily(embedded_target):
    assert gguf_file(embedded_target).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    ids = embedded_target.encode_chat([{"role": "user", "content": "What is 12 plus 30?"}])[0]
    hidden = torch.randn(8, embedded_target.hidden_size, dtype=torch.bfloat16)
    weight = torch.randn(1536, embedded_target.hidden_size, dtype=torch.bfloat16)
    # oneDNN's AMX kernels on an AMX CPU first: llama.cpp's would fault on the same threads
    Linear(weight, None, can_pack(hidden.device, hidden.dtype))(hidden)
    method = llamacpp(embedded_target, max_new_tokens=12, threads=1)
    assert method.pid != os.getpid(), "llama.cpp decodes in a process of its own"
    first, second = method(ids), method(ids)
    method.close()
    assert not psutil.pid_exists(method.pid) or psutil.Process(method.pid).status() == psutil.STATUS_ZOMBIE
    assert 1 <= len(first.tokens) <= 12 and first.tokens == second.tokens, "greedy decoding is deterministic"
    assert all(0 <= t < embedded_target.vocab_size for t in first.tokens)
    assert first.seconds > 0 and first.steps == len(first.tokens) - 1
    text = embedded_target.tokenizer.decode(first.tokens, skip_special_tokens=True)
    assert any(ch.isdigit() for ch in text), f"llama.cpp on the Q4_1 file should answer with a number: {text!r}"


@pytest.mark.slow
def test_bench_peer_row_stays_out_of_exactness(embedded_target):
    from taps_ray.models.drafter import DraftHead

    ids = embedded_target.encode_chat([{"role": "user", "content": "Name a colour."}])[0]
    drafter = DraftHead(embedded_target.config, seed=0).to(embedded_target.device, embedded_target.dtype).eval()
    from taps_ray.config import TreeConfig

    with torch.inference_mode():
        report = run_bench(embedded_target, [ids], drafter, TreeConfig(depth=1, top_k=2, total_tokens=3),
                           max_new_tokens=6, hf=False, peers=["llamacpp"],
                           settings={"benchmark": "one", "drafter": "fresh"})
    rows = {row.method: row for row in report.methods}
    assert list(rows) == ["vanilla", "spec", "spec-cost", "llamacpp"]
    assert rows["llamacpp"].tokens_per_s > 0 and "speed reference" in rows["llamacpp"].note
    assert "llamacpp" not in report.exactness.to_dict()["identical"]


def _serve_faulting_with_extra_buffers(conn, *args, extra_buffers: bool = True):
    """llama.cpp's serve as on an AMX machine where its AMX kernels fault (ggml-org/llama.cpp#26954)."""
    if extra_buffers:
        os.kill(os.getpid(), signal.SIGILL)
    llamacpp_child.serve(conn, *args, extra_buffers=extra_buffers)


@pytest.mark.slow
def test_llamacpp_starts_again_without_extra_buffers_when_its_kernels_fault(embedded_target, monkeypatch):
    monkeypatch.setattr(peers, "llamacpp_child", SimpleNamespace(serve=_serve_faulting_with_extra_buffers))
    method = llamacpp(embedded_target, max_new_tokens=4, threads=1)
    assert "buffers off" in method.note and f"exit code {-signal.SIGILL}" in method.note
    ids = embedded_target.encode_chat([{"role": "user", "content": "Say hi."}])[0]
    assert 1 <= len(method(ids).tokens) <= 4
    method.close()

"""benchmarks/gpu_check.py on the CPU with the tiny config, so the GPU check cannot rot between GPU sessions."""

from __future__ import annotations

import json

from benchmarks import gpu_check


def test_gpu_check_runs_every_engine_exactly(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--size", "tiny", "--device", "cpu", "--dtype", "float32", "--new-tokens", "24",
                           "--prompt-len", "16", "--depth", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["all_identical"] and set(report["engines"]) == {"static", "static+graphs", "hf"}
    graphs = report["engines"]["static+graphs"]["graphs"]
    assert graphs == {"captured": False, "captures": 0, "capture_s": 0.0}, "on a CPU the fixed-shape step runs eagerly"
    for engine in report["engines"].values():
        assert engine["greedy_identical"] and engine["tokens"] == 24
        assert set(engine["random_heads"]) == {"eagle2", "eagle3"}
        assert all(head["greedy_identical"] for head in engine["random_heads"].values())
        assert engine["oracle_tau"] > 3, "the oracle's chain should be accepted almost whole"
        assert [int(n) for n in engine["verify_ms"]] == list(gpu_check.NODES)
        assert all(ms > 0 for ms in engine["verify_ms"].values())
        assert engine["verify_cost_vs_plain"]["1"] == 1.0


def test_chain_oracle_proposes_the_reference_with_decoys():
    import torch

    from taps_ray.spec.protocol import DecodeState

    oracle = gpu_check.ChainOracle([5, 6, 7, 8, 9, 10], vocab_size=64, depth=3)
    tree = oracle.propose(DecodeState(torch.tensor([5, 6]), 1, 1, 0))
    assert tree.tokens[0] == 6 and tree.prefix_len == 1
    chain = [i for i in range(1, tree.size, 2)]
    assert tree.tokens[chain].tolist() == [7, 8, 9]
    assert tree.parent[chain].tolist() == [0, 1, 3]
    assert all(tree.tokens[i + 1] != tree.tokens[i] for i in chain)

import pytest
import torch

from taps_ray.models.engine import can_pack
from taps_ray.models.quant import q4q8_unsupported, quantize_rtn
from taps_ray.spec.draft_compute import INT4_HEAD_ROWS, DraftHeadProduct, draft_head_kind, draft_log_probs


def _rows(vocab: int = 300, hidden: int = 64, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.1).to(dtype)


def _kinds() -> list[tuple[str, torch.dtype]]:
    kinds = [("dense", torch.float32), ("dense", torch.bfloat16), ("half", torch.float32), ("int4", torch.bfloat16)]
    kinds += [("packed", dtype) for dtype in (torch.float32, torch.bfloat16) if can_pack(torch.device("cpu"), dtype)]
    kinds += [("q4q8", dtype) for dtype in (torch.float32, torch.bfloat16)
              if q4q8_unsupported(torch.device("cpu"), dtype) is None]
    return kinds


@pytest.mark.parametrize("kind,dtype", _kinds())
def test_every_kind_computes_each_row_as_if_drafted_alone(kind, dtype):
    head = DraftHeadProduct(_rows(dtype=dtype), kind)
    hidden = torch.randn(2 * INT4_HEAD_ROWS + 3, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    together = head(hidden)
    assert together.dtype == torch.float32 and together.shape == (hidden.shape[0], 300)
    for start in range(hidden.shape[0]):
        alone = head(hidden[start:start + 1])
        if kind == "dense":
            torch.testing.assert_close(alone, together[start:start + 1], rtol=1e-2, atol=1e-5)
        else:
            assert torch.equal(alone, together[start:start + 1])
    exact = hidden.float() @ _rows(dtype=dtype).float().T
    bound = 0.15 if kind in ("int4", "q4q8") else 0.02  # round-to-nearest codes, checked closely below
    assert float((together - exact).abs().max()) < bound * float(exact.abs().max())


def test_int4_head_reads_the_round_to_nearest_codes_of_the_rows():
    rows = _rows()
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    expected = hidden.float() @ quantize_rtn(rows).dequantize().T
    torch.testing.assert_close(DraftHeadProduct(rows, "int4")(hidden), expected, rtol=0.02, atol=0.02)


@pytest.mark.skipif(q4q8_unsupported(torch.device("cpu"), torch.bfloat16) is not None, reason="no q4q8 kernel here")
def test_q4q8_head_reads_the_int4_codes_of_the_rows_times_int8_activations():
    rows = _rows()
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    int4, q4q8 = DraftHeadProduct(rows, "int4")(hidden), DraftHeadProduct(rows, "q4q8")(hidden)
    assert q4q8.shape == (3, 300) and not torch.equal(int4, q4q8)
    torch.testing.assert_close(q4q8, int4, rtol=0.05, atol=0.05 * float(int4.abs().max()))


@pytest.mark.parametrize("kind", ["int4", "q4q8"])
def test_a_4bit_head_falls_back_where_the_rows_cannot_be_grouped(kind):
    head = DraftHeadProduct(_rows(hidden=40), kind)
    assert head.kind in ("packed", "dense")


@pytest.mark.parametrize("kind,dtype", _kinds())
def test_a_copy_drops_the_product_and_makes_it_again(kind, dtype):
    import copy
    import pickle

    head = DraftHeadProduct(_rows(dtype=dtype), kind)
    hidden = torch.randn(2, 64).to(dtype)
    expected = head(hidden)
    for other in (copy.deepcopy(head), pickle.loads(pickle.dumps(head))):
        assert other._product is None and torch.equal(other(hidden), expected)


def test_sessions_drafting_at_once_share_one_product(monkeypatch):
    import threading

    from taps_ray.spec import draft_compute

    made: list[int] = []
    real = draft_compute.HalfLinear

    def counted(rows, bias):
        made.append(1)
        threading.Event().wait(0.05)  # a build long enough for every thread to arrive
        return real(rows, bias)

    monkeypatch.setattr(draft_compute, "HalfLinear", counted)
    head = DraftHeadProduct(_rows(dtype=torch.float32), "half")
    start = threading.Barrier(6)
    threads = [threading.Thread(target=lambda: (start.wait(), head(torch.ones(1, 64)))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1


def test_unknown_kind_names_the_valid_ones():
    with pytest.raises(ValueError, match="int4, q4q8, packed, half or dense.*'fp8'"):
        DraftHeadProduct(_rows(), "fp8")


class _Target:
    def __init__(self, weights, packed, dtype=torch.bfloat16):
        self.weights, self.dtype = weights, dtype
        self.engine = None if packed is None else type("Engine", (), {"packed": packed})()


KERNEL = q4q8_unsupported(torch.device("cpu"), torch.float32) is None


@pytest.mark.parametrize("weights,packed,dtype,kind", [
    ("int4", True, torch.bfloat16, "int4"), ("fp16", None, torch.float32, "q4q8" if KERNEL else "half"),
    ("q4q8", True, torch.bfloat16, "q4q8"), ("q4q8", True, torch.float32, "q4q8"),
    ("dense", True, torch.float32, "packed"), ("dense", False, torch.float32, "dense"),
    ("dense", None, torch.float32, "dense")])
def test_draft_head_kind_follows_the_targets_weights_and_engine(weights, packed, dtype, kind):
    assert draft_head_kind(_Target(weights, packed, dtype)) == kind


def test_an_fp16_target_drafts_on_half_weights_where_the_q4q8_kernel_cannot_run(monkeypatch):
    from taps_ray.spec import draft_compute

    monkeypatch.setattr(draft_compute, "q4q8_unsupported", lambda device, dtype: "no C compiler here")
    assert draft_head_kind(_Target("fp16", None, torch.float32)) == "half"


def test_log_probs_normalise_and_report_entropy():
    head = DraftHeadProduct(_rows(dtype=torch.float32), "dense")
    logp, entropy, lse = draft_log_probs(head, torch.randn(2, 64))
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2))
    assert (entropy > 0).all() and lse.shape == (2,)


def test_an_int4_target_reads_its_draft_vocabulary_as_int4_codes_whatever_its_size(tiny_target):
    """In decoding the head's rows are read after a target step has pushed them out of the caches, where the int4
    codes are read faster than a packed copy at the rows drafted at once: a small draft vocabulary and a whole one
    both keep the codes; a dense target keeps the dense rows."""
    from taps_ray.models.drafter import DraftHead
    from taps_ray.spec import draft_compute

    weight = _rows(vocab=tiny_target.vocab_size, hidden=tiny_target.hidden_size)
    small = DraftHead(tiny_target.config, draft_to_target=torch.arange(64))
    whole = DraftHead(tiny_target.config)
    assert draft_compute.draft_head_rows(small, weight, "int4").kind == "int4"
    assert draft_compute.draft_head_rows(whole, weight, "int4").kind == "int4"
    assert draft_compute.draft_head_rows(small, weight, "dense").kind == "dense"

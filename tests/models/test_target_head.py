"""load_target_head reads the target's embedding and LM head and no other tensor, from a single safetensors
file or a sharded checkpoint, and gives the full target's fingerprint; drafter replicas and the training
driver load their target through it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

import taps_ray.models.target_head as target_head
from taps_ray.config import ExperimentConfig, TargetConfig, TreeConfig
from taps_ray.models.drafter import DraftHead
from taps_ray.models.quant import fp16_unsupported
from taps_ray.models.target import TargetModel
from taps_ray.models.target_head import INDEX_FILE, SINGLE_FILE, TargetHead, load_target_head
from tests.conftest import tiny_llama_config
from tests.models.test_target_families import COMMON, FAMILIES

VOCAB, HIDDEN = 128, 32
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def save_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def save_target(folder: Path, tied: bool, max_shard_size: str | None = None) -> Path:
    """A seeded tiny Llama (tied or untied LM head) with a word-level tokenizer, saved to ``folder``."""
    config = tiny_llama_config(vocab_size=VOCAB, hidden_size=HIDDEN)
    config.tie_word_embeddings = tied
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    if max_shard_size:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


class Spy:
    """Wraps ``safe_open`` in the loader: records the files opened and every tensor read from them."""

    def __init__(self, monkeypatch):
        self.read: list[str] = []
        self.files: set[str] = set()
        original = target_head.safe_open
        spy = self

        class Handle:
            def __init__(self, path, framework="pt", device="cpu"):
                spy.files.add(Path(path).name)
                self._inner = original(path, framework=framework, device=device)

            def __enter__(self):
                self._inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self._inner.__exit__(*exc)

            def keys(self):
                return self._inner.keys()

            def get_tensor(self, name):
                spy.read.append(name)
                return self._inner.get_tensor(name)

            def get_slice(self, name):
                spy.read.append(name)
                return self._inner.get_slice(name)

        monkeypatch.setattr(target_head, "safe_open", Handle)

        def no_full_load(*args, **kwargs):
            raise AssertionError("the full target was loaded")

        monkeypatch.setattr(target_head.TargetModel, "load", no_full_load)


def full(folder: Path) -> TargetModel:
    return TargetModel.load(TargetConfig(model=str(folder), device="cpu", dtype="float32"))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("shard", [None, "24KB"], ids=["single-file", "sharded"])
def test_reads_only_embedding_and_lm_head(tmp_path, monkeypatch, tied, shard):
    folder = save_target(tmp_path / "target", tied, shard)
    if shard:
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        assert len(set(weight_map.values())) > 2 and not (folder / SINGLE_FILE).exists()
        if not tied:
            assert weight_map[EMBED] != weight_map[LM_HEAD]
    else:
        assert (folder / SINGLE_FILE).exists() and not (folder / INDEX_FILE).exists()
    reference = full(folder)

    spy = Spy(monkeypatch)
    head = load_target_head(TargetConfig(model=str(folder), device="cpu", dtype="float32"))
    expected = [EMBED] if tied else [EMBED, LM_HEAD]
    assert spy.read == expected and list(head.tensors_read) == expected
    if shard:
        assert spy.files == {weight_map[k] for k in expected}
    assert head.fingerprint == reference.fingerprint
    assert torch.equal(head.embed_tokens.weight, reference.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, reference.lm_head.weight)
    assert (head.lm_head.weight is head.embed_tokens.weight) == tied
    assert head.eos_token_ids == reference.eos_token_ids and head.max_context == reference.max_context
    assert (head.vocab_size, head.hidden_size, head.dtype, head.device) == (VOCAB, HIDDEN, torch.float32,
                                                                             torch.device("cpu"))
    tokens = torch.tensor([5, 9, 2])
    assert torch.equal(head.embed_tokens(tokens), reference.embed_tokens(tokens))


def test_fingerprint_agrees_across_dtypes(tmp_path, monkeypatch):
    """A bf16 head has the fp32 target's fingerprint, so drafters trained on either load on both."""
    folder = save_target(tmp_path / "target", tied=False)
    reference = full(folder)
    Spy(monkeypatch)
    head = load_target_head(TargetConfig(model=str(folder), device="cpu", dtype="bfloat16"))
    assert head.dtype == torch.bfloat16 and head.fingerprint == reference.fingerprint


def assert_same_trees(tmp_path, monkeypatch, cfg: TargetConfig) -> list:
    """Save a drafter for the full target of ``cfg``, draft one tree next to it and next to ``cfg``'s head alone
    (only the embedding read), assert the trees are equal; returns the two drafters as loaded."""
    from taps_ray.spec.decoder import load_drafter
    from taps_ray.spec.tree import DrafterState, draft_tree

    reference = TargetModel.load(cfg)
    saved = DraftHead(reference.config, seed=1).eval().save(tmp_path / "drafter", reference.fingerprint)
    Spy(monkeypatch)
    head = load_target_head(cfg)
    assert head.weights == reference.weights and TargetHead.of(reference).weights == reference.weights
    tokens = torch.tensor([4, 8, 15, 16])
    features = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(0))
    trees, drafters = [], []
    for target in (reference, head):
        drafters.append(load_drafter(target, str(saved)))
        state = DrafterState(drafters[-1])
        state.add(tokens, features)
        trees.append(draft_tree(drafters[-1], target, state, TreeConfig(depth=3, top_k=3, total_tokens=10)))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parent, trees[1].parent)
    return drafters


def test_drafts_the_same_tree_as_the_full_target(tmp_path, monkeypatch):
    folder = save_target(tmp_path / "target", tied=False)
    assert_same_trees(tmp_path, monkeypatch, TargetConfig(model=str(folder), device="cpu", dtype="float32"))


@pytest.mark.skipif(fp16_unsupported(torch.device("cpu"), torch.float32) is not None, reason="no fbgemm fp16 GEMM here")
def test_an_fp16_targets_head_drafts_as_the_full_target_does(tmp_path, monkeypatch):
    """A drafter deployment of an fp16 target drafts with the draft head and its linears as in-process next to the
    full fp16 target (on the q4q8 kernel where it runs, else in half precision): the same trees."""
    from taps_ray.models.quant import HalfLinearForward, Q8LinearForward, q4q8_unsupported

    folder = save_target(tmp_path / "target", tied=False)
    cfg = TargetConfig(model=str(folder), device="cpu", dtype="float32", weights="fp16")
    drafters = assert_same_trees(tmp_path, monkeypatch, cfg)
    assert load_target_head(cfg).weights == "fp16"
    kind = Q8LinearForward if q4q8_unsupported(torch.device("cpu"), torch.float32) is None else HalfLinearForward
    assert all(isinstance(d.fc.__dict__.get("forward"), kind) for d in drafters)
    assert load_target_head(TargetConfig(model=str(folder), device="cpu", dtype="float32")).weights == "dense"


def test_callers_load_only_the_head(tmp_path, monkeypatch):
    """The Serve drafter replica and the training driver load the target through load_target_head."""
    from taps_ray.serving.drafter import Drafter
    from taps_ray.train.launch import load_training_target

    folder = save_target(tmp_path / "target", tied=True, max_shard_size="24KB")
    spy = Spy(monkeypatch)
    replica = Drafter("math", {"model": str(folder), "device": "cpu", "dtype": "float32"},
                      TreeConfig(depth=2, top_k=2, total_tokens=5).model_dump())
    assert isinstance(replica.target, TargetHead) and spy.read == [EMBED]
    replica.reconfigure({"checkpoint": None, "seed": 0})
    out = asyncio.run(replica.propose("r1", 0, torch.tensor([3, 4]), torch.randn(2, HIDDEN)))
    assert 1 < out["tree"].tokens.numel() <= 5

    spy.read.clear()
    driver = load_training_target(ExperimentConfig(target=TargetConfig(model=str(folder), device="cuda")))
    assert isinstance(driver, TargetHead) and driver.device.type == "cpu" and spy.read == [EMBED]


def test_embedded_target_head(monkeypatch, embedded_target):
    """SmolLM2-135M ties its LM head to the embedding: one tensor read, the full target's fingerprint."""
    spy = Spy(monkeypatch)
    head = load_target_head(TargetConfig(dtype="float32"))
    assert spy.read == [EMBED] and head.lm_head.weight is head.embed_tokens.weight
    assert head.fingerprint == embedded_target.fingerprint
    assert torch.equal(head.lm_head.weight, embedded_target.lm_head.weight)


def test_gguf_falls_back_to_the_full_model(monkeypatch):
    loaded = []

    def fake_load(cfg):
        loaded.append(cfg.model)
        raise target_head.TargetLoadError("stop here")

    monkeypatch.setattr(target_head.TargetModel, "load", fake_load)
    with pytest.raises(target_head.TargetLoadError, match="stop here"):
        load_target_head(TargetConfig(model="/nowhere/model.gguf", device="cpu"))
    assert loaded == ["/nowhere/model.gguf"]


def test_hub_checkpoint_downloads_only_the_shards_it_reads(tmp_path, monkeypatch):
    """From the hub: the shard index, then only the shards holding the embedding and the LM head."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    folder = save_target(tmp_path / "target", tied=False, max_shard_size="24KB")
    downloaded = []

    def fake_download(repo, filename, **kwargs):
        assert repo == "org/tiny"
        if not (folder / filename).is_file():
            raise EntryNotFoundError(f"{filename} not in {repo}")
        downloaded.append(filename)
        return str(folder / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    get = target_head._hub_file("org/tiny")
    files = target_head._tensor_files(get)
    tensors = {key: target_head._read(get, files, key) for key in (EMBED, LM_HEAD)}
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    assert downloaded[0] == INDEX_FILE and set(downloaded[1:]) == {weight_map[EMBED], weight_map[LM_HEAD]}
    assert len(set(weight_map.values())) > len(set(downloaded[1:]))
    assert tensors[EMBED].shape == tensors[LM_HEAD].shape == (VOCAB, HIDDEN)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_head_equals_the_full_targets(tmp_path, monkeypatch, family):
    """Every supported family: the head embeds as the full target does (Gemma's scaled embedding included),
    has its LM head and fingerprint, reading only those tensors."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model_cls(config_cls(**COMMON, **extra)).save_pretrained(tmp_path / family, max_shard_size="100KB")
    save_tokenizer(tmp_path / family, COMMON["vocab_size"])
    reference = full(tmp_path / family)
    spy = Spy(monkeypatch)
    head = load_target_head(TargetConfig(model=str(tmp_path / family), device="cpu", dtype="float32"))
    tied = reference.lm_head.weight.data_ptr() == reference.embed_tokens.weight.data_ptr()
    assert len(spy.read) == (1 if tied else 2) and head.fingerprint == reference.fingerprint
    assert type(head.embed_tokens) is type(reference.embed_tokens)
    tokens = torch.tensor([0, 7, 255])
    assert torch.equal(head.embed_tokens(tokens), reference.embed_tokens(tokens))
    assert torch.equal(head.lm_head.weight, reference.lm_head.weight)

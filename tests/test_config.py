import pytest

from taps_ray.config import ConfigError, ExperimentConfig, load_config
from tests.conftest import REPO


def test_demo_and_paper_configs_validate():
    demo = load_config(REPO / "configs/demo.yaml")
    assert demo.target.model == "embedded:smollm2-135m"
    assert set(demo.data.datasets) == {"math", "chat"}
    paper = load_config(REPO / "configs/paper-llama3-8b.yaml")
    assert paper.mixtures["mixed-35k"].counts == {"math": 35000, "chat": 35000}
    assert (paper.tree.depth, paper.tree.top_k, paper.tree.total_tokens) == (5, 10, 60)


def test_dotted_override_is_parsed_as_yaml():
    cfg = load_config(REPO / "configs/demo.yaml", ["data.features.max_len=512", "tree.depth=2"])
    assert cfg.data.features.max_len == 512 and cfg.tree.depth == 2


def test_unknown_key_names_key_and_allowed_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("target:\n  modle: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "target.modle" in message and "unknown key" in message and "model" in message


def test_bad_type_names_key_value_and_rule():
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/demo.yaml", ["data.features.max_len=abc"])
    assert "data.features.max_len" in str(err.value) and "'abc'" in str(err.value)
    with pytest.raises(ConfigError, match="tree.total_tokens"):
        load_config(None, ["tree.total_tokens=1"])
    with pytest.raises(ConfigError, match="device"):
        load_config(None, ["target.device=tpu"])


def test_mixture_validation():
    base = {"data": {"datasets": {"a": {"domain": "x", "alternatives": [{"kind": "sharegpt"}]}}}}
    with pytest.raises(ValueError, match="sum to 1"):
        ExperimentConfig.model_validate({**base, "mixtures": {"m": {"ratio": {"a": 0.7}}}})
    with pytest.raises(ValueError, match="unknown dataset"):
        ExperimentConfig.model_validate({**base, "mixtures": {"m": {"counts": {"b": 3}}}})
    with pytest.raises(ValueError, match="exactly one"):
        ExperimentConfig.model_validate({**base, "mixtures": {"m": {"ratio": {"a": 1.0}, "counts": {"a": 1}}}})


def test_missing_file_and_bad_override():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope.yaml")
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["tree.depth"])


def test_unknown_source_kind_and_gsm_symbolic_are_rejected():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.datasets={m: {domain: math, alternatives: [{kind: sharegtp}]}}"])
    message = str(err.value)
    assert "kind" in message and "'sharegtp'" in message and "'sharegpt'" in message
    with pytest.raises(ConfigError, match="gsm_symbolic.*GSM8K test"):
        load_config(None, ["data.datasets={m: {domain: math, alternatives: "
                           "[{kind: reasoning_gym, tasks: [basic_arithmetic, gsm_symbolic]}]}}"])

import argparse
import re
from typing import get_args

import pytest
import yaml
from pydantic import BaseModel, Field

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


# -- field descriptions and the examples the docs give --------------------------------------------

def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _undocumented(roots) -> list[str]:
    """``Model.field`` of every field without a one-line description, in ``roots`` and the models below them."""
    seen: set[type[BaseModel]] = set()
    todo, missing = list(roots), []
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            text = field.description or ""
            if not text.strip() or "\n" in text:
                missing.append(f"{model.__name__}.{name}")
            todo += _models_in(field.annotation)
    return sorted(missing)


def test_every_config_field_has_a_one_line_description():
    import taps_ray.config as experiment
    import taps_ray.config_serve as serve
    import taps_ray.sweeps.config as sweeps

    defined = [m for module in (experiment, serve, sweeps) for m in vars(module).values()
               if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == module.__name__]
    assert {"ExperimentConfig", "ServeConfig", "ObjectiveConfig", "MixtureSweepSpec", "Dimension"} <= {
        m.__name__ for m in defined}
    assert _undocumented(defined) == []

    class Nested(BaseModel):
        documented: int = Field(default=0, description="one line")
        bare: int = 0

    class Outer(BaseModel):
        inner: dict[str, list[Nested]] = Field(default_factory=dict, description="nested")
        two_lines: str = Field(default="", description="a\nb")

    assert _undocumented([Outer]) == ["Nested.bare", "Outer.two_lines"]


_EXAMPLE = re.compile(r"\b([a-z_]+(?:\.[a-z_0-9]+)+=[^\s`,)]+)")


def _value_at(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_example_overrides_in_docstrings_and_help_are_keys_that_exist():
    import taps_ray.config as experiment
    from taps_ray.cli import build_parser
    from taps_ray.sweeps.config import load_spec

    examples = {"experiment": _EXAMPLE.findall(experiment.__doc__ or ""), "sweep": []}
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, parser in commands.items():
        for action in parser._actions:
            if action.dest == "overrides":
                examples["sweep" if name == "sweep" else "experiment"] += _EXAMPLE.findall(action.help or "")
    assert "data.features.max_len=512" in examples["experiment"] and examples["sweep"]
    for example in examples["experiment"]:
        key, value = example.split("=", 1)
        assert _value_at(load_config(REPO / "configs/demo.yaml", [example]), key) == yaml.safe_load(value), example
    for example in examples["sweep"]:
        key, value = example.split("=", 1)
        assert _value_at(load_spec(REPO / "tune/mixture.yaml", overrides=[example]), key) == yaml.safe_load(value)


def test_eagle3_is_an_algorithm_of_variants_and_sweeps():
    from taps_ray.sweeps.config import _check_mixture_value

    cfg = load_config(None, ["data.datasets={math: {domain: math, alternatives: [{kind: gsm8k_test_split}]}}",
                             "mixtures={m: {counts: {math: 4}}}",
                             "variants=[{name: e3, mixture: m, algorithm: eagle3, objective: {ttt_steps: 2}}]"])
    variant = cfg.variants[0]
    assert variant.algorithm == "eagle3" and variant.objective_config().passes == 2
    assert cfg.variant_train(variant).stage2 is None
    _check_mixture_value("algorithm", "eagle3")
    with pytest.raises(ValueError, match="algorithm must be eagle2, hass or eagle3, got 'eagle4'"):
        _check_mixture_value("algorithm", "eagle4")
    with pytest.raises(ConfigError, match="eagle3"):
        load_config(None, ["variants=[{name: x, mixture: m, algorithm: eagle4}]"])


def test_serve_knobs_sit_in_sections_and_a_flat_key_names_its_new_place():
    from taps_ray.config_serve import MOVED, SECTIONS, ServeConfig

    cfg = load_config(None, ["serve.admission.max_queued_requests=3", "serve.batching.max_tokens=16",
                             "serve.routing.probe_steps=4", "serve.verifier.num_replicas=2"])
    assert (cfg.serve.admission.max_queued_requests, cfg.serve.batching.max_tokens) == (3, 16)
    assert (cfg.serve.routing.probe_steps, cfg.serve.verifier.num_replicas) == (4, 2)
    with pytest.raises(ConfigError, match=r"serve.batch_max_tokens is now serve.batching.max_tokens; "
                                          r"serve.host is now serve.http.host"):
        load_config(None, ["serve.batch_max_tokens=16", "serve.host=0.0.0.0"])
    for old, new in MOVED.items():
        section, key = new.split(".")
        assert key in SECTIONS[section].model_fields and old not in ServeConfig.model_fields, (old, new)
    every = [f"{s}.{k}" for s, model in SECTIONS.items() for k in model.model_fields]
    assert sorted(every) == sorted(set(MOVED.values())), "every sectioned knob was a flat key once, and only once"

"""``taps`` argument handling that does not need a model: eval flags become config overrides."""

from __future__ import annotations

import pytest

from taps_ray.cli import build_parser, parse
from taps_ray.commands.study import eval_overrides
from taps_ray.config import load_config
from tests.conftest import REPO

DEMO = str(REPO / "configs" / "demo.yaml")


def _eval_config(*flags: str):
    args = build_parser().parse_args(["eval", DEMO, *flags])
    return load_config(args.config, list(args.overrides) + eval_overrides(args))


def test_drafters_flag_composes_the_given_drafters_unless_told_otherwise():
    assert _eval_config().eval.compose == ["math", "chat"]
    cfg = _eval_config("--drafters", "regen=a,ref=b,fresh=random:0", "--limit", "20")
    assert cfg.eval.drafters == {"regen": "a", "ref": "b", "fresh": "random:0"} and cfg.eval.compose is None
    assert cfg.eval.limit == 20
    cfg = _eval_config("--drafters", "x=a,y=b,z=c", "--compose", "z,x")
    assert cfg.eval.compose == ["z", "x"]


def test_overrides_may_follow_the_flags_and_stray_arguments_are_rejected(capsys):
    args = parse(["train", "configs/demo.yaml", "tree.depth=3", "--variants", "hass-math", "train.epochs=2"])
    assert args.overrides == ["tree.depth=3", "train.epochs=2"] and args.variants == "hass-math"
    for bad in (["train", "configs/demo.yaml", "--variants", "x", "stray"], ["train", "configs/demo.yaml", "--nope"]):
        with pytest.raises(SystemExit) as err:
            parse(bad)
        assert err.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_export_writes_an_eagle_folder_that_loads_back(tmp_path, capsys):
    import torch

    from taps_ray.cli import main
    from taps_ray.models.drafter import DraftHead
    from tests.conftest import make_tiny_target

    target = make_tiny_target(0)
    head = DraftHead(target.config, draft_to_target=torch.arange(50, 150), seed=4, metadata={"name": "math"})
    with torch.no_grad():
        head.fc.bias.fill_(0.5)
    own = head.save(tmp_path / "math", target.fingerprint)
    assert main(["export", str(own), "--format", "eagle", "--out", str(tmp_path / "eagle")]) == 0
    out = capsys.readouterr().out
    assert "bias: true" in out and f"--speculative-draft-model-path {tmp_path / 'eagle'}" in out
    assert f"--speculative-token-map {tmp_path / 'eagle' / 'hot_token_map.pt'}" in out
    loaded = DraftHead.load(tmp_path / "eagle", target.config, target.fingerprint)
    assert all(torch.equal(loaded.trainable_state()[k], v) for k, v in head.trainable_state().items())
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)

    eagle = str(tmp_path / "eagle")
    refusals = {
        "reduced vocabulary of 100 tokens": [str(own), "--out", str(tmp_path / "x"), "--engine", "vllm"],
        "is the drafter's own folder": [str(own), "--out", str(own)],
        "already an EAGLE checkpoint": [eagle, "--out", str(tmp_path / "x")],
    }
    for message, argv in refusals.items():
        assert main(["export", *argv, "--format", "eagle"]) == 2
        assert message in capsys.readouterr().err


def test_serve_api_key_flags_add_to_the_configured_keys(monkeypatch, capsys):
    from taps_ray import cli
    from taps_ray.commands import drafting
    from taps_ray.serving import app

    served = []
    monkeypatch.setattr(app, "run", lambda cfg, host, port: served.append((cfg, host, port)))
    assert drafting.run_serve(parse(["serve", DEMO, "serve.http.api_keys=[k0]", "--api-key", "k1", "--api-key", "k2",
                                 "--port", "8123"])) == 0
    cfg, _, port = served[0]
    assert cfg.serve.http.api_keys == ["k0", "k1", "k2"] and port == 8123
    assert cli.main(["serve", DEMO, "--api-key", "has space"]) == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "has space" not in err
    assert len(served) == 1


def test_config_help_prints_each_key_with_type_default_and_description(capsys):
    from taps_ray.cli import main
    from taps_ray.config import FeaturesConfig, ObjectiveConfig, TreeConfig
    from taps_ray.config_serve import AdmissionConfig
    from taps_ray.sweeps.config import SchedulerSpec

    def described(model, field: str) -> str:
        return model.model_fields[field].description

    assert main(["config-help"]) == 0
    out = capsys.readouterr().out
    for line, model, field in [
        ("tree.depth: int = 2", TreeConfig, "depth"),
        ("data.features.max_len: int = 384", FeaturesConfig, "max_len"),
        ("serve.admission.max_queued_requests: int = 8", AdmissionConfig, "max_queued_requests"),
        ('target.dtype: auto | float32 | bfloat16 | float16 = "auto"', None, None),
        ("variants[].objective.hass_passes: int = 3", ObjectiveConfig, "hass_passes"),
        ("data.datasets.<name>.alternatives[].kind: sharegpt | gsm8k_train", None, None),
    ]:
        assert line in out, line
        if model is not None:
            assert f"{line}\n    {described(model, field)}\n" in out
    assert "prompt-lookup chain grafted onto each tree, at most this long (0: off)" in out
    assert "scheduler.kind" not in out  # sweep keys come with --sweep

    assert main(["config-help", "serve.drafters"]) == 0
    keys = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert keys[:2] == ["serve.drafters", "serve.drafters.<name>.checkpoint"]
    assert all(k.startswith("serve.drafters") for k in keys)

    assert main(["config-help", "--sweep", "scheduler.grace_period"]) == 0
    assert capsys.readouterr().out == (f"scheduler.grace_period: int = 1\n"
                                       f"    {described(SchedulerSpec, 'grace_period')}\n")

    assert main(["config-help", "tree.dpeth"]) == 2
    assert "no key 'tree.dpeth'" in capsys.readouterr().err
    assert main(["config-help", "--markdown", "tree"]) == 2


def test_docs_config_md_is_what_config_help_generates(capsys):
    from taps_ray.cli import main

    assert main(["config-help", "--markdown"]) == 0
    generated = capsys.readouterr().out
    assert "| `serve.admission.max_queued_requests` | `int` | `8` |" in generated
    assert generated == (REPO / "docs" / "CONFIG.md").read_text(), (
        "docs/CONFIG.md is out of date: run `taps config-help --markdown > docs/CONFIG.md`")


@pytest.mark.parametrize("flags, message", [
    (["--traffic", "t"], "--traffic DIR and --drafter SRC are required (or --watch beside a running taps serve)"),
    (["--watch", "--new"], "--watch fine-tunes the serving version at adapt.traffic_share"),
    (["--watch", "--traffic-share", "0.3"], "--new, --out and --traffic-share do not apply"),
])
def test_adapt_refuses_flags_that_do_not_fit_together_before_loading_anything(flags, message, capsys, tmp_path):
    from taps_ray.cli import main

    assert main(["adapt", DEMO, *flags, f"output_dir={tmp_path}"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_measures_the_cost_model_and_caches_it_for_every_decode(tmp_path, monkeypatch, capsys):
    import json

    from taps_ray.cli import main
    from taps_ray.config import TargetConfig
    from taps_ray.models.target import TargetModel
    from taps_ray.spec.cost import cost_model

    monkeypatch.setenv("TAPS_CACHE", str(tmp_path))
    assert main(["calibrate", DEMO, "target.dtype=float32", "--threads", "1", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["nodes"][0] == 1 and len(measured["verify_s"]) == len(measured["nodes"])
    assert measured["key"]["threads"] == 1 and measured["key"]["dtype"] == "float32"
    assert json.loads(open(measured["path"]).read())["verify_s"] == measured["verify_s"]
    target = TargetModel.load(TargetConfig(dtype="float32"))
    monkeypatch.setattr("taps_ray.spec.cost.measure", lambda *a, **k: pytest.fail("measured again"))
    assert cost_model(target).verify_s == measured["verify_s"]
    assert main(["calibrate", DEMO, "--threads", "0"]) == 2


def test_every_command_has_its_help_line_arguments_and_run():
    from taps_ray.cli import COMMANDS, command

    for name in COMMANDS:
        help_text, add_arguments, run = command(name)
        assert len(help_text) > 20 and "\n" not in help_text, name
        assert callable(add_arguments) and callable(run), name


def test_bench_refuses_bad_flags_before_loading_a_model(capsys, monkeypatch):
    from taps_ray.cli import main

    monkeypatch.setattr("taps_ray.models.target.TargetModel.load", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["bench", DEMO, "--limit", "0"]) == 2
    assert "--limit and --max-new-tokens must be >= 1, got 0 and 64" in capsys.readouterr().err
    assert main(["bench", DEMO, "--sweep", "--sweep-total", "1"]) == 2
    assert "invalid sweep values" in capsys.readouterr().err
    assert main(["bench", DEMO, "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
    assert main(["bench", DEMO, "--benchmark", "nope"]) == 2
    assert "unknown benchmark 'nope'; valid names: mt_bench, gsm8k" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_times_vanilla_and_speculation_and_writes_its_report(tmp_path, capsys):
    import json

    from taps_ray.cli import main

    out = tmp_path / "bench"
    assert main(["bench", DEMO, "target.dtype=float32", "--drafter", "random:0", "--limit", "1",
                 "--max-new-tokens", "4", "--no-hf", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "taps bench: target dtype float32" in printed.err and "weights dense" in printed.err
    report = json.loads((out / "bench.json").read_text())
    assert [row["method"] for row in report["methods"]] == ["vanilla", "spec", "spec-cost"]
    assert all(row["tokens"] > 0 and row["match"] == 1.0 for row in report["methods"])
    assert report["settings"]["dtype"] == "float32" and "drafter: random:0" in (out / "bench.md").read_text()
    assert "| spec-cost |" in printed.out

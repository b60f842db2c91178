"""The promotion gate and log (pure): a version is promoted only when its held-out traffic tau beats the
serving version's by more than ``min_gain`` and no other domain loses more than ``margin``. The hot swap
against a fake deployment handle: a swap that reached only some replicas is rolled back on all of them."""

from __future__ import annotations

import pytest

from taps_ray.adapt.promote import (
    Decision,
    PartialSwap,
    PromotionError,
    PromotionLog,
    ServedDrafter,
    decide,
    record,
)
from taps_ray.config import load_config


def tau(traffic: tuple[float, float], **originals: tuple[float, float]) -> dict:
    return {"traffic": {"before": traffic[0], "after": traffic[1]},
            **{n: {"before": b, "after": a} for n, (b, a) in originals.items()}}


@pytest.mark.parametrize("record_, margin, min_gain, promote, reason", [
    (tau((2.0, 2.4), math=(3.0, 2.98), chat=(2.0, 2.1)), 0.05, 0.0, True, "gain +0.400"),
    (tau((2.0, 2.4), math=(3.0, 2.90)), 0.05, 0.0, False, "tau on math drops by 0.100, more than the margin 0.050"),
    (tau((2.0, 2.4), math=(3.0, 2.95)), 0.05, 0.0, True, "largest loss on another domain 0.050"),
    (tau((2.0, 2.0), math=(3.0, 3.5)), 0.05, 0.0, False, "traffic tau gain +0.000 is not above +0.000"),
    (tau((2.0, 2.2)), 0.05, 0.3, False, "traffic tau gain +0.200 is not above +0.300"),
    (tau((2.0, 1.9), math=(3.0, 3.0)), 1.0, 0.0, False, "gain -0.100 is not above"),
    (tau((2.0, 2.5), math=(3.0, 2.0), chat=(2.0, 1.8)), 0.15, 0.0, False, "tau on math drops by 1.000"),
])
def test_the_gate_promotes_only_a_traffic_gain_that_costs_no_original_domain_more_than_the_margin(
        record_, margin, min_gain, promote, reason):
    decision = decide(record_, margin, min_gain)
    assert decision.promote is promote
    assert reason in decision.reason
    assert decision.gain == pytest.approx(record_["traffic"]["after"] - record_["traffic"]["before"])
    assert decision.losses == pytest.approx({n: t["before"] - t["after"] for n, t in record_.items() if n != "traffic"})


def test_a_record_without_traffic_is_refused_by_name():
    with pytest.raises(ValueError, match="no 'traffic' domain .*'math'"):
        decide({"math": {"before": 1.0, "after": 2.0}}, 0.05)


def test_the_log_keeps_every_decision_and_names_the_last_promoted_checkpoint_per_drafter(tmp_path):
    log = PromotionLog(tmp_path)
    assert log.entries() == [] and log.last_promoted("math") is None
    adapt = {"tau": tau((2.0, 2.5)), "traffic_rows": 40}
    log.append(record("math", 1, tmp_path / "v1", "release:math", Decision(True, "ok", 0.5, {}), adapt, 64))
    log.append(record("math", 2, tmp_path / "v2", str(tmp_path / "v1"), Decision(False, "no", 0.0, {}), adapt, 128))
    log.append(record("chat", 3, tmp_path / "v3", "release:chat", Decision(True, "ok", 0.5, {}), adapt, 192))
    assert [e["version"] for e in log.entries()] == [1, 2, 3]
    assert log.last_promoted("math") == str(tmp_path / "v1") and log.last_promoted("chat") == str(tmp_path / "v3")
    assert log.entries()[1]["parent"] == str(tmp_path / "v1") and log.entries()[1]["captured"] == 128
    assert log.path == tmp_path / "adapt" / "promotions.jsonl"


def test_promoting_into_an_unknown_or_averaged_drafter_is_refused_before_any_cluster_call():
    cfg = load_config(None, ["serve.drafters={a: {seed: 0}, b: {seed: 1}, ab: {average_of: [a, b]}}"])
    with pytest.raises(PromotionError, match="no drafter 'c'; drafters: \\['a', 'ab', 'b'\\]"):
        ServedDrafter(cfg, "c")
    with pytest.raises(PromotionError, match="'ab' is the weight average of \\['a', 'b'\\]"):
        ServedDrafter(cfg, "ab")


class Broadcast:
    def __init__(self, outcomes: list):
        self.outcomes = outcomes

    def results(self, timeout_s=None, return_exceptions=False):
        errors = [o for o in self.outcomes if isinstance(o, BaseException)]
        if errors and not return_exceptions:
            raise errors[0]
        return self.outcomes


class FakeDeployment:
    """A drafter deployment's handle: ``broadcast`` reaches every replica; replica R raises loading a
    checkpoint of ``refuse[R]``; ``starting`` replicas join during the next ``reconfigure`` broadcast,
    from the configured checkpoint, without receiving it (as Serve starts a replica)."""

    def __init__(self, replicas: list[str], checkpoint: str):
        self.specs = dict.fromkeys(replicas, checkpoint)
        self.refuse: dict[str, set[str]] = {}
        self.starting: dict[str, str] = {}
        self.reconfigures = 0

    def broadcast(self, method: str, *args):
        if method == "stats":
            return Broadcast([{"replica": n, "spec": {"checkpoint": c}} for n, c in self.specs.items()])
        self.reconfigures += 1
        wanted, outcomes = args[0]["checkpoint"], []
        for name in self.specs:
            if wanted in self.refuse.get(name, ()):
                outcomes.append(RuntimeError(f"{name} cannot load {wanted}"))
            else:
                self.specs[name] = wanted
                outcomes.append(None)
        self.specs.update(self.starting)
        self.starting = {}
        return Broadcast(outcomes)


@pytest.fixture
def deployment(monkeypatch):
    """``ServedDrafter`` of drafter ``a`` (configured checkpoint v0) over three replicas serving v0."""
    fake = FakeDeployment(["r1", "r2", "r3"], "v0")
    monkeypatch.setattr(ServedDrafter, "_handle", lambda self: fake)
    served = ServedDrafter(load_config(None, ["serve.drafters={a: {checkpoint: v0}}"]), "a")
    return served, fake


def test_a_swap_only_some_replicas_took_is_rolled_back_on_all_and_names_both_sides(deployment, caplog):
    served, fake = deployment
    assert [r["spec"]["checkpoint"] for r in served.swap("v1")] == ["v1"] * 3 and served.promoted == "v1"
    fake.refuse["r3"] = {"v2"}
    with pytest.raises(PartialSwap, match=r"partial swap, rolled back: replica\(s\) \['r1', 'r2'\] took v2, "
                                          r"\['r3'\] did not \(RuntimeError: r3 cannot load v2\); every replica "
                                          r"serves v1 again"):
        served.swap("v2")
    assert fake.specs == dict.fromkeys(["r1", "r2", "r3"], "v1") and served.promoted == "v1"
    assert "reached replica(s) ['r1', 'r2'] only" in caplog.text
    assert served.reconcile() == 0 and fake.reconfigures == 3


def test_a_partial_first_swap_goes_back_to_the_configured_checkpoint_and_reconcile_finishes_a_rollback(
        deployment):
    """Replica r1 cannot load v0 just then either: it stays on v1 until a reconcile moves it."""
    served, fake = deployment
    fake.refuse = {"r3": {"v1"}, "r1": {"v0"}}
    with pytest.raises(PartialSwap, match=r"\['r1'\] do not serve v0 yet: reconcile moves them on each poll"):
        served.swap("v1")
    assert fake.specs == {"r1": "v1", "r2": "v0", "r3": "v0"} and served.promoted == "v0"
    fake.refuse = {}
    assert served.reconcile() == 1 and fake.specs == dict.fromkeys(["r1", "r2", "r3"], "v0")
    assert served.reconcile() == 0


def test_a_replica_started_during_the_swap_is_asked_again_and_no_replica_taking_it_changes_nothing(deployment):
    served, fake = deployment
    fake.starting = {"r4": "v0"}
    served.swap("v1")
    assert fake.specs == dict.fromkeys(["r1", "r2", "r3", "r4"], "v1") and served.promoted == "v1"
    fake.refuse = dict.fromkeys(fake.specs, {"v2"})
    with pytest.raises(PromotionError, match="no replica took v2 .*each keeps the version it served") as err:
        served.swap("v2")
    assert not isinstance(err.value, PartialSwap)
    assert set(fake.specs.values()) == {"v1"} and served.promoted == "v1"

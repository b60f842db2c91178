"""The ingress' metrics: one table of series (``metrics.toml``, read into :data:`SERIES`), recorded
through Ray Serve's metrics and into the replica's own Prometheus page.

Where to read them. Every value goes to a ``ray.serve.metrics`` series: all ingress replicas record
into the same series, which Ray tags with ``deployment``, ``replica`` and ``application``; Ray's
metrics export (each node's Prometheus endpoint, ``ray.nodes()[i]["MetricsExportPort"]``, which
Ray's dashboard and Grafana read) serves them cluster-wide as ``ray_<name>`` (counters
``ray_<name>_total``). The same values also go to a per-replica ``prometheus_client`` registry that
``GET /metrics`` renders: with several ingress replicas each page shows only the share of the
replica that answered it.

Names. Every series has a ``taps_`` name. With ``serve.http.metrics_names: vllm`` the series vLLM also
has are recorded a second time under vLLM's name, so dashboards built for vLLM work: on
``/metrics`` as a vLLM server writes them (``vllm:spec_decode_num_drafts_total``), in Ray's export
as vLLM's own Ray stat logger writes them (``:`` becomes ``_``, which Ray requires:
``ray_vllm_spec_decode_num_drafts_total``, what Ray Serve LLM's dashboard reads).

Meaning, counted from each finished request's ``taps`` block (see
:func:`taps_ray.serving.session.summarize`), as vLLM counts: a draft is one verified tree (one
drafted step), its draft tokens are the tree's nodes besides the root, accepted tokens are draft
tokens the target accepted before any trimming (at ``max_tokens``, EOS or a stop sequence), and
per-position accepted tokens count drafts whose accepted path reached that position (0-based). So
``1 + accepted / drafts`` is vLLM's mean acceptance length, and equals tau
(:func:`taps_ray.spec.stats.acceptance_length`) of the same steps before trimming when every step
drafted. Inter-token latency is one observation per verification step (as vLLM observes one per
engine step): each step of a request counts that request's mean step time, decode time after the
first token over its steps, so the page's sum and count are exact (in Ray's export the counts are exact,
its histogram sums approximate).
"""

from __future__ import annotations

import threading
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from ray.serve import metrics as serve_metrics

disable_created_metrics()

MetricsNames = Literal["taps", "vllm"]
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


@dataclass(frozen=True)
class Series:
    """One metric: ``kind`` counter, gauge or histogram, its ``taps_`` name (counters without
    ``_total``), help text, labels besides ``model_name``, histogram buckets, vLLM's name if it has one,
    and the :class:`ServingMetrics` attribute that records it."""

    kind: Literal["counter", "gauge", "histogram"]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    vllm: str | None = None
    attribute: str = ""


BUCKETS = {"latency": LATENCY_BUCKETS, "token": TOKEN_BUCKETS, "tau": TAU_BUCKETS}


def _read_series(text: str) -> dict[str, Series]:
    """The series declared in ``metrics.toml`` (a section a series, keyed by its ``taps_`` name)."""
    series = {}
    for name, row in tomllib.loads(text).items():
        series[name] = Series(row["kind"], name, row["doc"], tuple(row.get("labels", ())),
                              BUCKETS[row["buckets"]] if "buckets" in row else (),
                              "vllm:" + name.removeprefix("taps_") if row.get("vllm") else None, row["attribute"])
    return series


SERIES = _read_series(resources.files(__package__).joinpath("metrics.toml").read_text())
"""Every series, by ``taps_`` name."""


def ray_name(name: str) -> str:
    """``name`` as recorded through Ray (``:`` is not allowed there; vLLM maps it to ``_`` too)."""
    return name.replace(":", "_")


_PROMETHEUS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
_RAY = {"counter": serve_metrics.Counter, "gauge": serve_metrics.Gauge, "histogram": serve_metrics.Histogram}


class Family:
    """One :class:`Series` under each of its names, in the replica's registry and through Ray Serve;
    ``labels(model, *values)`` gives the child to ``inc`` / ``dec`` / ``observe``, as prometheus_client
    does. Ray gauges only take ``set``: the value per label set is kept here."""

    def __init__(self, series: Series, names: tuple[str, ...], registry: CollectorRegistry):
        self.series = series
        self.keys = ("model_name", *series.labels)
        extra = {"buckets": series.buckets} if series.kind == "histogram" else {}
        self.pages = [_PROMETHEUS[series.kind](n, series.doc, list(self.keys), registry=registry, **extra)
                      for n in names]
        extra = {"boundaries": list(series.buckets)} if series.kind == "histogram" else {}
        self.rays = [_RAY[series.kind](ray_name(n), series.doc, tag_keys=self.keys, **extra) for n in names]
        self.values: dict[tuple[str, ...], float] = {}
        self.lock = threading.Lock()

    def labels(self, *values: str) -> _Child:
        if len(values) != len(self.keys):
            raise ValueError(f"{self.series.name}: labels {self.keys}, got {values}")
        return _Child(self, tuple(str(v) for v in values))


class _Child:
    def __init__(self, family: Family, values: tuple[str, ...]):
        self.family, self.values = family, values
        self.tags = dict(zip(family.keys, values))
        self.pages = [page.labels(*values) for page in family.pages]

    def inc(self, amount: float = 1.0) -> None:
        if amount == 0:
            return
        for page in self.pages:
            page.inc(amount)
        if self.family.series.kind == "gauge":
            self._set_ray(amount)
        else:
            for metric in self.family.rays:
                metric.inc(amount, tags=self.tags)

    def dec(self, amount: float = 1.0) -> None:
        for page in self.pages:
            page.dec(amount)
        self._set_ray(-amount)

    def set(self, value: float) -> None:
        """A gauge's value."""
        for page in self.pages:
            page.set(value)
        with self.family.lock:
            self.family.values[self.values] = value
        for metric in self.family.rays:
            metric.set(value, tags=self.tags)

    def observe(self, value: float, times: int = 1) -> None:
        """Observe ``value`` ``times`` times."""
        for _ in range(times):
            for page in self.pages:
                page.observe(value)
            for metric in self.family.rays:
                metric.observe(value, tags=self.tags)

    def _set_ray(self, delta: float) -> None:
        family = self.family
        with family.lock:
            value = family.values[self.values] = family.values.get(self.values, 0.0) + delta
        for metric in family.rays:
            metric.set(value, tags=self.tags)


class ServingMetrics:
    """Every series of :data:`SERIES` as an attribute (``success``, ``running``, ...), under the
    ``taps_`` names and, with ``names="vllm"``, vLLM's as well; :meth:`render` is the replica's page."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str, names: MetricsNames = "taps"):
        self.model = model
        self.cost_model: dict | None = None
        self.registry = CollectorRegistry()
        for series in SERIES.values():
            both = (series.name, series.vllm) if names == "vllm" and series.vllm else (series.name,)
            setattr(self, series.attribute, Family(series, both, self.registry))

    def finished(self, finish: str, usage: dict, taps: dict, latency_s: float, ttft_s: float | None) -> None:
        m = self.model
        self.success.labels(m, finish).inc()
        self.prompt_tokens.labels(m).inc(usage["prompt_tokens"])
        self.generation_tokens.labels(m).inc(usage["completion_tokens"])
        self.strategy_requests.labels(m, taps["strategy"]).inc()
        self.steps.labels(m).inc(taps["steps"])
        self.drafts.labels(m).inc(taps["drafted_steps"])
        self.draft_tokens.labels(m).inc(taps["draft_tokens"])
        self.accepted_tokens.labels(m).inc(taps["accepted_tokens"])
        self.plain_steps.labels(m).inc(taps["plain_steps"])
        self.shrunk_steps.labels(m).inc(taps.get("shrunk_steps", 0))
        self.shed_draft_tokens.labels(m).inc(taps.get("shed_draft_tokens", 0))
        reached = [sum(a > p for a in taps["accept_lengths"]) for p in range(max(taps["accept_lengths"], default=0))]
        for position, count in enumerate(reached):
            self.accepted_per_pos.labels(m, str(position)).inc(count)
        for drafter, count in taps["route_decisions"].items():
            self.route_decisions.labels(m, drafter).inc(count)
        for drafter, reasons in taps["skipped"].items():
            for reason, count in reasons.items():
                self.drafter_skips.labels(m, drafter, reason).inc(count)
        if taps.get("cost_model"):
            self.record_cost(taps["cost_model"])
        if taps["tau"] is not None:
            self.tau.labels(m).observe(taps["tau"])
        self.e2e.labels(m).observe(latency_s)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
            if usage["completion_tokens"] > 1:
                self.tpot.labels(m).observe((latency_s - ttft_s) / (usage["completion_tokens"] - 1))
            if taps["steps"]:
                self.itl.labels(m).observe((latency_s - ttft_s) / taps["steps"], times=taps["steps"])

    def record_cost(self, cost: dict) -> None:
        """Keep the verifier's cost model (:meth:`~taps_ray.serving.verifier.Verifier.cost_info`) and set its gauges."""
        self.cost_model = cost
        self.plain_step_s.labels(self.model).set(cost["plain_step_ms"] / 1e3)
        for nodes, relative in cost["relative"].items():
            self.verify_cost.labels(self.model, str(nodes)).set(relative)

    def failed(self, status: int) -> None:
        self.failure.labels(self.model, str(status)).inc()

    def serving_versions(self, replicas: dict[str, dict[int, int]]) -> None:
        """``taps_drafter_version``: drafter -> version -> replicas serving it; a version no replica of a
        drafter serves any more drops to 0."""
        family = self.drafter_versions
        with family.lock:
            seen = [k[1:] for k in family.values if k[0] == self.model]
        for drafter, version in seen:
            if str(version) not in {str(v) for v in replicas.get(drafter, {})}:
                family.labels(self.model, drafter, version).set(0)
        for drafter, versions in replicas.items():
            for version, count in versions.items():
                family.labels(self.model, drafter, str(version)).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_current: ServingMetrics | None = None


def register(metrics: ServingMetrics) -> ServingMetrics:
    """Make ``metrics`` this process's serving metrics (what error handlers outside a replica count into)."""
    global _current
    _current = metrics
    return metrics


def current() -> ServingMetrics | None:
    return _current

"""The ``serve`` section of the experiment configuration (``taps serve``), grouped by concern: what is served
at the top, then ``http``, ``limits``, ``admission``, ``batching``, ``routing``, ``verifier``, ``ingress`` and
``capture``, each knob once. A config that still uses a key of the flat section it replaced is refused with
the knob's new place (:data:`MOVED`). :mod:`taps_ray.config` re-exports :class:`ServeConfig`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from taps_ray.config_loading import Strict


class DrafterServeConfig(Strict):
    """One drafter deployment of ``taps serve``: a checkpoint, or the weight average of two others."""

    checkpoint: str | None = Field(default=None, description=(
        "drafter folder or release:NAME (None: a freshly initialised drafter from seed, logged as untrained)"))
    seed: int = Field(default=0, description="seed of a freshly initialised drafter")
    average_of: list[str] | None = Field(default=None, min_length=2, max_length=2, description=(
        "instead of a checkpoint: two other drafters A, B of serve.drafters, averaged (strategy averaged:ALPHA)"))
    alpha: float = Field(default=0.5, ge=0.0, le=1.0, description="average_of weight: alpha * A + (1 - alpha) * B")
    num_replicas: int = Field(default=1, ge=1, description="replicas when autoscaling is not given")
    autoscaling: dict[str, Any] | None = Field(default=None, description="Ray Serve autoscaling_config keys")
    num_cpus: float = Field(default=0.5, ge=0, description="CPUs per replica")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs per replica (fractions share one)")
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "extra Ray resources per replica, e.g. {drafter_node: 1} to place replicas on nodes offering it"))
    threads: int | None = Field(default=1, ge=1, description="torch threads per replica")
    max_ongoing_requests: int = Field(default=32, ge=1, description="Serve's max_ongoing_requests per replica")
    batch_sessions: int = Field(default=8, ge=1, description=(
        "per replica: sessions drafting at once, sharing each drafter forward (1: one at a time)"))
    fault: Literal["raise"] | None = Field(default=None, description=(
        "drills and tests: raise fails every draft call"))
    delay_s: float = Field(default=0.0, ge=0, description="drills and tests: sleep before each draft call")


class CaptureConfig(Strict):
    """``serve.capture``: finished requests kept as training rows in the feature-cache format (off by
    default). It stores prompts and outputs: turn it on only where that is allowed."""

    enabled: bool = Field(default=False, description=(
        "write finished requests (prompt and output) as rows; stores user data, off by default"))
    mode: Literal["stored", "all"] = Field(default="stored", description=(
        "stored: only chat requests that send OpenAI's store: true are kept; all: every finished request (the "
        "operator's choice; tell your users)"))
    dir: str | None = Field(default=None, description=(
        "the capture folder, one feature set (None: $TAPS_CACHE/capture/<app_name>)"))
    sample_rate: float = Field(default=1.0, ge=0.0, le=1.0, description=(
        "share of finished requests kept (each drawn independently)"))
    features: bool = Field(default=True, description=(
        "keep the target features the decode loop computed (false: token ids only, features recomputed later)"))
    max_rows: int | None = Field(default=100_000, ge=1, description=(
        "rows kept at most; the oldest shards are removed beyond it (None: no row limit)"))
    max_bytes: int | None = Field(default=2**30, ge=1, description=(
        "bytes of shards kept at most; the oldest shards are removed beyond it (None: no size limit)"))
    rows_per_shard: int = Field(default=64, ge=1, description=(
        "rows buffered per replica before a shard is written (also written when the replica shuts down)"))
    max_age_s: float | None = Field(default=None, gt=0, allow_inf_nan=False, description=(
        "seconds a shard is kept after it was written; older ones are removed at the next write (None: no age "
        "limit)"))


def default_serve_drafters() -> dict[str, DrafterServeConfig]:
    """The shipped release drafters (``math``, ``chat``: ``release:NAME``) when the package has them, else one
    untrained ``default`` drafter."""
    from taps_ray.drafter_sources import release_names

    shipped = [name for name in ("math", "chat") if name in release_names()]
    if not shipped:
        return {"default": DrafterServeConfig()}
    return {name: DrafterServeConfig(checkpoint=f"release:{name}") for name in shipped}


class HttpConfig(Strict):
    """``serve.http``: where the ingress listens, who may call it, and what it reads of a request before routing
    (checked by the ingress before any decoding work)."""

    host: str = Field(default="127.0.0.1", description=(
        "bind address (beyond loopback only with api_keys, or allow_unauthenticated: refused otherwise)"))
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port")
    api_keys: list[str] = Field(default_factory=list, exclude=True, repr=False, description=(
        "Bearer keys accepted on every route but /health and /ready (also --api-key and TAPS_API_KEY; none: "
        "open); never dumped"))
    allow_unauthenticated: bool = Field(default=False, description=(
        "serve without API keys on an address beyond loopback (refused otherwise: fail closed); logged as a warning"))
    allowed_hosts: list[str] = Field(default_factory=list, description=(
        "accepted Host header names (*.example.com wildcards; empty: any)"))
    docs: bool = Field(default=False, description="serve FastAPI's /docs, /redoc and /openapi.json")
    metrics_names: Literal["taps", "vllm"] = Field(default="taps", description=(
        "metric names: taps (taps_* only) or vllm (vLLM's spec-decode, request and latency names as well, "
        "so dashboards built for vLLM work; see serving/metrics.py)"))
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024, description="request-body cap (413 beyond it)")
    body_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False, description=(
        "seconds to receive a whole request body once its headers are in (408 beyond: trickled bodies)"))

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, value: list[str]) -> list[str]:
        if any(not k or not k.isascii() or not k.isprintable() or any(c.isspace() for c in k) for k in value):
            raise ValueError("serve.http.api_keys: each key must be non-empty printable ASCII without spaces")
        return value


class LimitsConfig(Strict):
    """``serve.limits``: what one request may ask for (400 beyond) and how long it may take."""

    max_messages: int = Field(default=256, ge=1, description="messages per chat request")
    max_prompt_chars: int = Field(default=200_000, ge=1, description="characters over all messages / the prompt")
    max_prompt_tokens: int = Field(default=32_768, ge=1, description=(
        "token ids of a completions prompt given as ids, refused (400) at the ingress beyond it"))
    max_stop_sequences: int = Field(default=8, ge=0, description="stop strings per request")
    max_stop_chars: int = Field(default=256, ge=1, description="characters per stop string")
    max_tokens_default: int = Field(default=256, ge=1, description=(
        "max_tokens of a request that gives none (capped by the room left in the context)"))
    max_tokens_cap: int = Field(default=4096, ge=1, description="the largest max_tokens a request may ask for")
    request_timeout_s: float = Field(default=300.0, gt=0, description=(
        "a request's whole budget from its arrival, queueing included (504 beyond; also an idle drafting "
        "session's lifetime)"))
    max_buffered_events: int = Field(default=64, ge=1, description=(
        "output events (a decoding step's text each) a verifier holds for one request that its reader has not "
        "taken; beyond them the request's decoding waits (until read, cancelled or timed out)"))


class AdmissionConfig(Strict):
    """``serve.admission``: load shedding. A request beyond ``max_concurrent_requests`` decoding and
    ``max_queued_requests`` waiting is answered at once with a 429. The defaults (8 decoding, 8 waiting) suit a
    2-core CPU with the embedded target; on a GPU raise ``max_concurrent_requests`` to what fits its memory."""

    max_concurrent_requests: int = Field(default=8, ge=1, description=(
        "requests decoding at once per verifier replica (the Verifier's Serve max_ongoing_requests)"))
    max_queued_requests: int = Field(default=8, ge=1, description=(
        "requests waiting for a slot, per ingress replica (its admission and Serve's max_queued_requests); "
        "beyond it a 429"))
    max_requests_per_key: int | None = Field(default=None, ge=1, description=(
        "requests one API key may have admitted at once per ingress replica, 429 beyond (None: with several keys, "
        "every admitted slot but one, so no key holds them all)"))
    retry_after_s: float = Field(default=1.0, gt=0, allow_inf_nan=False, description=(
        "Retry-After of a 429 (rounded up to whole seconds)"))


class BatchingConfig(Strict):
    """``serve.batching``: the steps of several requests verified in one target forward, per verifier replica."""

    max_requests: int = Field(default=8, ge=1, description=(
        "steps of that many requests verified in one target forward (1: each alone)"))
    wait_ms: float = Field(default=2.0, ge=0, allow_inf_nan=False, description=(
        "how long a step waits for the other decoding requests' steps to join its forward (drafter "
        "deployments batch their sessions' forwards with the same wait)"))
    max_tokens: int = Field(default=64, ge=0, description=(
        "per target forward: tree nodes its requests share; under load each tree is cut to its share (0: no cut)"))
    min_tree_nodes: int = Field(default=4, ge=1, description=(
        "a request whose share of max_tokens is smaller decodes its step plainly, without drafting"))


class RouteProbe(Strict):
    """Request-granularity routing's probe knobs, declared once for ``eval`` and ``serve.routing``."""

    probe_steps: int = Field(default=2, ge=1, description=(
        "request-granularity routing: steps that probe every drafter before one is chosen"))
    recheck_every: int = Field(default=0, ge=0, description=(
        "request-granularity routing: re-probe every that many steps (0: decide once per request, or eval turn)"))


class RoutingConfig(RouteProbe):
    """``serve.routing``: how a served request drafts with remote drafters."""

    draft_deadline_s: float = Field(default=1.0, ge=0, description=(
        "per step: a drafter that has not answered by then is skipped for that step"))
    max_draft_deadline_s: float | None = Field(default=None, ge=0, description=(
        "the largest taps.draft_deadline_s a request may ask for, 400 beyond (None: draft_deadline_s, so "
        "clients may only shorten it)"))

    @property
    def draft_deadline_cap_s(self) -> float:
        """The largest per-request ``taps.draft_deadline_s`` accepted."""
        return self.draft_deadline_s if self.max_draft_deadline_s is None else self.max_draft_deadline_s


class VerifierConfig(Strict):
    """``serve.verifier``: the Verifier deployment (the target)."""

    num_replicas: int = Field(default=1, ge=1, description="Verifier (target) replicas")
    num_cpus: float = Field(default=1.0, ge=0, description="CPUs per Verifier replica")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs per Verifier replica")
    resources: dict[str, float] = Field(default_factory=dict, description=(
        "extra Ray resources per Verifier replica, e.g. {verifier_node: 1} to place it on nodes offering it"))


class IngressConfig(Strict):
    """``serve.ingress``: the HTTP front end's deployment."""

    num_replicas: int = Field(default=1, ge=1, description="ingress (HTTP front end) replicas")
    num_cpus: float = Field(default=0.25, ge=0, description="CPUs per ingress replica")


SECTIONS = {"http": HttpConfig, "limits": LimitsConfig, "admission": AdmissionConfig, "batching": BatchingConfig,
            "routing": RoutingConfig, "verifier": VerifierConfig, "ingress": IngressConfig}
"""The sections of ``serve`` that group its knobs, by key."""

MOVED = {
    **{key: f"http.{key}" for key in HttpConfig.model_fields},
    **{key: f"limits.{key}" for key in LimitsConfig.model_fields},
    **{key: f"admission.{key}" for key in AdmissionConfig.model_fields},
    "batch_max_requests": "batching.max_requests", "batch_max_tokens": "batching.max_tokens",
    "min_tree_nodes": "batching.min_tree_nodes", "batch_wait_ms": "batching.wait_ms",
    "route_probe_steps": "routing.probe_steps", "route_recheck_every": "routing.recheck_every",
    "draft_deadline_s": "routing.draft_deadline_s", "max_draft_deadline_s": "routing.max_draft_deadline_s",
    "verifier_replicas": "verifier.num_replicas", "verifier_num_cpus": "verifier.num_cpus",
    "verifier_num_gpus": "verifier.num_gpus", "verifier_resources": "verifier.resources",
    "ingress_replicas": "ingress.num_replicas", "ingress_num_cpus": "ingress.num_cpus",
}
"""Keys of the flat ``serve`` section before it was grouped, and where each knob is now."""


class ServeConfig(Strict):
    """``taps serve``: Drafter deployments, one Verifier (the target) and the OpenAI-compatible ingress. What is
    served (the app, its model id, strategy and drafters) sits at the top; every other knob in one section:
    ``http`` (address, keys, what the ingress reads), ``limits`` (per request), ``admission`` (load shedding),
    ``batching`` (verification across requests), ``routing`` (remote drafting), ``verifier`` and ``ingress``
    (their deployments), ``capture`` (finished requests as training rows)."""

    app_name: str = Field(default="taps", description="the Ray Serve application's name")
    model_name: str | None = Field(default=None, description="the served model id (None: the target's name)")
    strategy: str = Field(default="single", description="decoding strategy when a request names none")
    drafters: dict[str, DrafterServeConfig] = Field(default_factory=default_serve_drafters, description=(
        "name -> drafter deployment, or just a checkpoint folder or release:NAME (default: the shipped "
        "release drafters, else one untrained drafter)"))
    default_drafters: list[str] | None = Field(default=None, description=(
        "drafters used when a request names none (None: every non-averaged drafter, in order)"))
    show_acceptance: bool | None = Field(default=None, description=(
        "per-step acceptance figures (taps.tau, accept_lengths, step counts, routes) in responses; None: shown "
        "unless capture is on or a `taps adapt` version drafted the request (drafters adapted on captured "
        "traffic would tell one client about others')"))
    http: HttpConfig = Field(default_factory=HttpConfig, description="address, API keys and request reading")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="what one request may ask for")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="load shedding (429s)")
    batching: BatchingConfig = Field(default_factory=BatchingConfig, description=(
        "verification of several requests' steps in one target forward"))
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="drafting with remote drafters")
    verifier: VerifierConfig = Field(default_factory=VerifierConfig, description="the Verifier deployment")
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="the ingress deployment")
    capture: CaptureConfig = Field(default_factory=CaptureConfig, description=(
        "keep finished requests as training rows (stores prompts and outputs; off by default)"))

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, value: Any) -> Any:
        if isinstance(value, dict):
            moved = [f"serve.{key} is now serve.{MOVED[key]}" for key in value if key in MOVED]
            if moved:
                raise ValueError("the serve section is grouped into sections: " + "; ".join(moved))
        return value

    def shows_acceptance(self, adapted: bool) -> bool:
        """Whether a response carries the per-step acceptance figures (``show_acceptance``, resolved);
        ``adapted``: a ``taps adapt`` version drafted the request."""
        if self.show_acceptance is not None:
            return self.show_acceptance
        return not (self.capture.enabled or adapted)

    @field_validator("drafters", mode="before")
    @classmethod
    def _drafter_shorthand(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: {"checkpoint": v} if v is None or isinstance(v, str) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _names(self) -> ServeConfig:
        if not self.drafters:
            raise ValueError("serve.drafters must name at least one drafter")
        for name, drafter in self.drafters.items():
            if not all(c.isalnum() or c in "_-." for c in name):
                raise ValueError(f"drafter name {name!r}: use letters, digits, '_', '-', '.'")
            for other in drafter.average_of or []:
                if other not in self.drafters or self.drafters[other].average_of:
                    raise ValueError(f"drafter {name!r}: average_of names {other!r}, which is not a plain "
                                     f"drafter of serve.drafters")
        for name in self.default_drafters or []:
            if name not in self.drafters:
                raise ValueError(f"default_drafters names unknown drafter {name!r}; drafters: {sorted(self.drafters)}")
        return self

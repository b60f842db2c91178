"""What a request asks for, resolved against the server config without torch: the ingress validates
strategy and drafters with it before anything reaches the verifier."""

from __future__ import annotations

from dataclasses import dataclass, field

from taps_ray.config import ServeConfig
from taps_ray.serving.protocol import RequestError
from taps_ray.spec.strategy import StrategyError, StrategySpec, parse_strategy

VERIFIER_DEPLOYMENT = "Verifier"


def drafter_deployment_name(name: str) -> str:
    """The Serve deployment that serves drafter ``name``."""
    return f"Drafter_{name}"


@dataclass(frozen=True)
class Plan:
    """How a request drafts: the parsed strategy and the drafter deployments it composes, in order."""

    spec: StrategySpec
    drafters: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        return self.spec.kind


def resolve_plan(strategy: str | None, drafters: list[str] | None, cfg: ServeConfig) -> Plan:
    """The :class:`Plan` for a request's ``taps.strategy`` / ``taps.drafters`` under the server config;
    :class:`RequestError` naming the field when either is unknown or they do not fit together.

    ``averaged[:ALPHA]`` is served by a drafter configured with ``average_of`` and that ``alpha``
    (weights are averaged when the deployment loads, not per request).
    """
    try:
        spec = parse_strategy(strategy or cfg.strategy)
    except ValueError as err:
        raise RequestError(str(err), "taps.strategy", code="strategy_not_found") from None
    unknown = [d for d in drafters or [] if d not in cfg.drafters]
    if unknown:
        raise RequestError(f"unknown drafter(s) {unknown}; this server has {sorted(cfg.drafters)}",
                           "taps.drafters", code="drafter_not_found")
    plain = [n for n, d in cfg.drafters.items() if not d.average_of]
    defaults = list(cfg.default_drafters or plain)
    if spec.kind == "vanilla":
        return Plan(spec)
    if spec.kind == "single":
        if spec.drafter is not None and spec.drafter not in cfg.drafters:
            raise RequestError(f"strategy {spec.name!r}: unknown drafter {spec.drafter!r}; this server has "
                               f"{sorted(cfg.drafters)}", "taps.strategy", code="drafter_not_found")
        if spec.drafter is not None and drafters and list(drafters) != [spec.drafter]:
            raise RequestError(f"strategy {spec.name!r} names its drafter; taps.drafters {drafters} disagrees",
                               "taps.drafters")
        chosen = [spec.drafter] if spec.drafter else list(drafters or defaults[:1])
        if len(chosen) != 1:
            raise RequestError(f"strategy 'single' takes one drafter, got {chosen}", "taps.drafters")
        return Plan(spec, _bind(spec, chosen))
    if spec.kind == "averaged":
        alpha = 0.5 if spec.alpha is None else spec.alpha
        served = [n for n, d in cfg.drafters.items() if d.average_of and abs(d.alpha - alpha) < 1e-6
                  and (not drafters or list(drafters) in (list(d.average_of), [n]))]
        if not served:
            have = {n: f"{d.alpha:g}*{d.average_of[0]} + {1 - d.alpha:g}*{d.average_of[1]}"
                    for n, d in cfg.drafters.items() if d.average_of}
            of = f" of {drafters}" if drafters else ""
            raise RequestError(f"no averaged drafter with alpha {alpha:g}{of} is served; averaged drafters: "
                               f"{have or 'none'} (configure one with serve.drafters.NAME.average_of and alpha)",
                               "taps.strategy", code="strategy_not_found")
        return Plan(spec, (served[0],))
    return Plan(spec, _bind(spec, list(drafters or defaults)))


def _bind(spec: StrategySpec, chosen: list[str]) -> tuple[str, ...]:
    """:meth:`StrategySpec.bind` of the request's drafters, its error a 400 naming the request field."""
    try:
        return spec.bind(chosen)
    except StrategyError as err:
        raise RequestError(str(err), f"taps.{err.field}") from None


@dataclass
class DecodeRequest:
    """One request as the ingress hands it over: ``prompt`` is chat messages, raw text (``raw``) or
    token ids; ``prompt_param`` names the request field for errors. ``request_id``: the HTTP request's
    id (error bodies and log lines name it); ``expires_at``: the wall-clock time (``time.time()``) its
    ``serve.limits.request_timeout_s`` runs out, counted from its arrival at the ingress (None: from the start
    of decoding); ``logprobs``: alternatives per token the response reports (None: no logprobs); ``store``: the client asked
    that the request be kept (OpenAI's ``store``), which ``serve.capture.mode: stored`` requires."""

    rid: str
    prompt: list[dict] | str | list[int]
    plan: Plan
    max_tokens: int | None = None
    sampling: dict = field(default_factory=dict)
    stop: list[str] | None = None
    raw: bool = False
    prompt_param: str = "messages"
    deadline_s: float | None = None
    request_id: str | None = None
    expires_at: float | None = None
    logprobs: int | None = None
    store: bool = False

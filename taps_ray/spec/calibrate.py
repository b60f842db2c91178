"""Engine settings that depend on the machine, measured once per machine with the cost model and cached.

An int4 target (a GGUF's Q4_1 codes) reads its codes in narrow steps and a packed dense copy in wide ones:
torch's int4 CPU kernel costs more with every few rows, oneDNN's dense product on AMX tiles hardly at all up to
16 rows but reads 3.6x the bytes. Where the two cross depends on the CPU: about 15 rows on an AVX-512 bf16 EPYC,
about 8-10 on a Sapphire Rapids with AMX (docs/BENCHMARKS.md). :func:`calibrate_int4_rows` times whole
verification forwards of each :data:`ROWS` count both ways and sets the engine's ``int4_max_rows`` to the
threshold with the least total time over them; :func:`~taps_ray.spec.cost.cost_model` calls it first, so the
cost curve is measured on the engine as it will run. Lossless either way: the codes' values are the dense
weights within the dtype's rounding, and exactness is accounted as for bf16.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import torch

from taps_ray.spec.machine import fingerprint
from taps_ray.spec.tree import build_tree

log = logging.getLogger(__name__)

ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16)
"""Step sizes timed both ways: every count up to 6 (the int4 kernel's steps come every 4 rows), then sparser."""


def int4_rows_path(key: dict) -> Path:
    """Where the measured ``int4_max_rows`` of fingerprint ``key`` is cached (``TAPS_CACHE/int4_rows/``)."""
    from taps_ray import artifacts

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return artifacts.cache_dir() / "int4_rows" / f"{digest}.json"


def best_threshold(codes_s: list[float], dense_s: list[float], rows: tuple[int, ...] = ROWS) -> int:
    """The threshold t (one of ``rows``) minimising the total seconds when steps of up to t rows read the codes
    and wider ones the dense copy, ``codes_s[i]``/``dense_s[i]`` timing ``rows[i]``; a total, not the first row
    count where dense wins, so that one noisy point does not move it. Ties keep the larger t."""
    totals = [sum(codes_s[: i + 1]) + sum(dense_s[i + 1:]) for i in range(len(rows))]
    best = min(totals)
    return max(r for r, total in zip(rows, totals) if total <= best)


def store_json(path: Path, record: dict) -> None:
    """Write ``record`` to the cache file ``path`` whole or not at all (a partial file per process and thread,
    renamed over it), making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.partial")
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, path)


def chain_trees(target, nodes, prefix: int) -> tuple[object, list, int]:
    """What a verification timing runs: a cache prefilled with random tokens (``prefix``, or fewer where the
    context must leave room for the longest chain) and a chain tree of each size in ``nodes`` after them;
    ``(cache, trees, prefix)``."""
    prefix = min(prefix, target.max_context - max(nodes) - 1)
    ids = torch.randint(2, target.vocab_size, (1, prefix), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(prefix + max(nodes))
    target.prefill(ids.to(target.device), cache)
    trees = [build_tree(list(range(2, 2 + n)), list(range(-1, n - 1)), prefix_len=prefix).to(target.device)
             for n in nodes]
    return cache, trees, prefix


def time_verify(target, tree, cache, prefix: int) -> float:
    """Seconds of one verification forward of ``tree`` (logits included) on ``cache``, cropped back to
    ``prefix`` entries after it (a CUDA device synchronised on both sides)."""
    from taps_ray.models.target_cache import crop_cache
    from taps_ray.spec.verify import run_tree

    cuda = target.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(target.device)
    start = time.perf_counter()
    run_tree(target, tree, cache)
    if cuda:
        torch.cuda.synchronize(target.device)
    seconds = time.perf_counter() - start
    crop_cache(cache, prefix)
    return seconds


@torch.inference_mode()
def measure_int4_rows(target, rows: tuple[int, ...] = ROWS, prefix: int = 192, repeats: int = 4) -> dict:
    """Seconds of one verification forward (a chain of n nodes, logits included, after a ``prefix``-token cache)
    per n in ``rows``, reading the codes and reading the dense copy, interleaved over ``repeats`` rounds after a
    warm-up (the fastest kept), and the :func:`best_threshold`. The engine's setting is restored afterwards."""
    engine = target.engine
    before = engine.int4_max_rows
    start = time.perf_counter()
    cache, trees, prefix = chain_trees(target, rows, prefix)
    seen: dict[str, list[float]] = {"codes": [float("inf")] * len(rows), "dense": [float("inf")] * len(rows)}
    try:
        for round_ in range(repeats + 1):
            for i, tree in enumerate(trees):
                for name, max_rows in (("codes", max(rows)), ("dense", 1)):
                    engine.set_int4_max_rows(max_rows)
                    seconds = time_verify(target, tree, cache, prefix)
                    if round_:
                        seen[name][i] = min(seen[name][i], seconds)
    finally:
        engine.set_int4_max_rows(before)
    codes_s, dense_s = seen["codes"], seen["dense"]
    dense_s[0] = codes_s[0]  # a one-token step reads the codes either way
    return {"rows": list(rows), "codes_s": codes_s, "dense_s": dense_s,
            "int4_max_rows": best_threshold(codes_s, dense_s, rows), "measured_s": round(time.perf_counter() - start, 2)}


_MEASURING = threading.Lock()


def calibrate_int4_rows(target, refresh: bool = False) -> int | None:
    """Set ``target``'s int4 engine to read its codes in steps of up to the measured threshold (cached per
    :func:`~taps_ray.spec.machine.fingerprint`, measured when missing or ``refresh``) and return it; None, and
    nothing changed, where the engine has no int4 products with a dense copy or its threshold was pinned
    (``target.int4_max_rows``)."""
    engine = getattr(target, "engine", None)
    if engine is None or getattr(engine, "int4_max_rows", None) is None or getattr(engine, "int4_rows_pinned", False):
        return None
    with _MEASURING:
        key = calibration_key(target)
        if engine.int4_rows_calibrated == key and not refresh:
            return engine.int4_max_rows
        path = int4_rows_path(key)
        record = None if refresh else _read_record(path, key)
        if record is None:
            record = {"key": key, **measure_int4_rows(target)}
            store_json(path, record)
            log.info("int4 target: steps of up to %d rows read the codes, wider ones the packed dense copy "
                     "(measured in %.1fs)", record["int4_max_rows"], record["measured_s"])
        engine.set_int4_max_rows(int(record["int4_max_rows"]))
        engine.int4_rows_calibrated = key
        return engine.int4_max_rows


def calibration_key(target) -> dict:
    """The key of ``target``'s cached threshold: its :func:`~taps_ray.spec.machine.fingerprint` less the
    threshold it runs with now."""
    return {**fingerprint(target), "int4_max_rows": "measured"}


def _read_record(path: Path, key: dict) -> dict | None:
    """The cached record at ``path`` if it is a readable record of ``key`` with a valid threshold, else None."""
    try:
        record = json.loads(path.read_text())
        valid = record.get("key") == key and int(record["int4_max_rows"]) >= 1
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return record if valid else None


def retire_int4_rows(cost_key: dict) -> bool:
    """Remove the cached threshold that the cost model of fingerprint ``cost_key`` ran with (both measured on a
    machine that was busy): the next process measures it again. True if removed."""
    if cost_key.get("int4_max_rows") is None:
        return False
    try:
        int4_rows_path({**cost_key, "int4_max_rows": "measured"}).unlink()
        return True
    except OSError:
        return False

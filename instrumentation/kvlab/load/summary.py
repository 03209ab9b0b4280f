"""From per-request records (requests.jsonl) to summary.json; the schema is documented in docs/lab.md."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA_VERSION = 1


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete JSON line of `path` (a line cut short by a killed writer is skipped)."""
    out: list[dict[str, Any]] = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _pcts(values: list[float], qs: tuple[int, ...]) -> dict[str, float | None]:
    if not values:
        return {**dict.fromkeys((f"p{q}" for q in qs), None), "mean": None}
    arr = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {f"p{q}": round(float(np.percentile(arr, q)), 3) for q in qs}
    out["mean"] = round(float(arr.mean()), 3)
    return out


def _fraction(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Latency percentiles, throughput, hit-rate decomposition and routing spread of one run.

    Rates use the measured window (first request sent to last one finished); hit rates are token
    fractions over successful requests: sum(available|predicted|delivered) / sum(prompt tokens),
    computed over the requests that report that number (None when none do, e.g. no gateway);
    `speculative` is the part of `predicted` the gateway's index held only speculatively.
    Inter-token latency three ways: `itl_ms` over each request's mean gap, `itl_max_ms` over each
    request's worst gap (decode stalls), `token_itl_ms` over every gap of every request (vLLM's
    benchmark definition of ITL percentiles).
    """
    ok = [r for r in records if not r.get("error")]
    errors = [r for r in records if r.get("error")]
    window = 0.0
    if records:
        start = min(r["ts"] for r in records)
        end = max(r["ts"] + r.get("e2e_ms", 0.0) / 1000 for r in records)
        window = max(end - start, 1e-9)
    out_tokens = sum(r.get("output_tokens") or 0 for r in ok)
    hit: dict[str, float | None] = {}
    for kind, key in (("available", "available_tokens"), ("predicted", "predicted_tokens"),
                      ("speculative", "speculative_tokens"), ("delivered", "cached_tokens")):
        rows = [r for r in ok if r.get(key) is not None and r.get("prompt_tokens")]
        hit[kind] = _fraction(sum(r[key] for r in rows), sum(r["prompt_tokens"] for r in rows))
    return {
        "schema": SCHEMA_VERSION,
        "requests": len(records),
        "ok": len(ok),
        "errors": len(errors),
        "first_error": errors[0]["error"] if errors else None,
        "duration_s": round(window, 3),
        "rps": round(len(ok) / window, 3) if window else 0.0,
        "output_tok_s": round(out_tokens / window, 3) if window else 0.0,
        "ttft_ms": _pcts([r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None], (50, 95, 99)),
        "itl_ms": _pcts([r["itl_ms"] for r in ok if r.get("itl_ms") is not None], (50, 95, 99)),
        "itl_max_ms": _pcts([r["itl_max_ms"] for r in ok if r.get("itl_max_ms") is not None], (50, 95, 99)),
        "token_itl_ms": _pcts([g for r in ok for g in r.get("itl_gaps_ms") or ()], (50, 95, 99)),
        "tpot_ms": _pcts([r["tpot_ms"] for r in ok if r.get("tpot_ms") is not None], (50, 95)),
        "e2e_ms": _pcts([r["e2e_ms"] for r in ok], (50, 95, 99)),
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in ok),
        "output_tokens": out_tokens,
        "hit_rate": hit,
        "replicas": dict(sorted(Counter(r.get("replica") or "?" for r in ok).items())),
    }

"""From measured medians to the simulator's step-time numbers (formula: kvlab.engine.sim.profile).

Alone on an idle engine, a request with n prompt tokens of which c are cached gets its first
token after its prefill steps, so the simulator predicts

    TTFT = request_overhead + steps * step_overhead + (n - c) * prefill_per_token
           + prefill_per_token_per_1k_ctx * (n - c) * (c + n - 1) / 2000

(steps = ceil((n - c) / max_num_batched_tokens); the last term is the sum of the computed tokens'
positions), and B requests decoding together get ITL = step_overhead + decode_base + B * per_seq.
The ITL line gives step_overhead (its intercept; decode_base is folded into it, the two are not
separable from these measurements) and per_seq (its slope). The three TTFT coefficients are then
fitted by non-negative least squares on *relative* error, so a 90-ms point weighs as much as a
3-s one.
"""

from __future__ import annotations

import itertools

import numpy as np

FIELDS = ("request_overhead_ms", "step_overhead_ms", "prefill_ms_per_token", "prefill_ms_per_token_per_1k_ctx",
          "decode_ms_base", "decode_ms_per_seq")


def steps(todo: int, max_batched: int) -> int:
    return max(1, -(-todo // max_batched))


def _ttft_terms(n: int, c: int) -> list[float]:
    """The TTFT's coefficients of (request_overhead, prefill_per_token, per_1k_ctx)."""
    todo = n - c
    return [1.0, float(todo), todo * (c + n - 1) / 2000]


def predict_ttft(p: dict[str, float], n: int, c: int, max_batched: int) -> float:
    req, per, ctx = _ttft_terms(n, c)
    return (p["request_overhead_ms"] * req + steps(n - c, max_batched) * p["step_overhead_ms"]
            + p["prefill_ms_per_token"] * per + p["prefill_ms_per_token_per_1k_ctx"] * ctx)


def predict_itl(p: dict[str, float], batch: int) -> float:
    return p["step_overhead_ms"] + p["decode_ms_base"] + batch * p["decode_ms_per_seq"]


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0, by trying every subset of free columns (three here)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(b ** 2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x_sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(a.shape[1])
            x[list(cols)] = x_sub
            err = float(np.sum((a @ x - b) ** 2))
            if err < best_err:
                best, best_err = x, err
    return best


def fit(ttft: dict[tuple[int, int], float], itl: dict[int, float], max_batched: int) -> dict[str, float]:
    """Profile numbers from TTFT medians keyed by (prompt tokens, cached tokens) and ITL medians keyed
    by batch size."""
    if len(itl) < 2 or len(ttft) < 3:
        raise ValueError("fit needs ITL at two batch sizes or more and TTFT at three points or more")
    bs = sorted(itl)
    slope, icept = np.polyfit(bs, [itl[b] for b in bs], 1)
    per_seq, over = max(0.0, float(slope)), max(0.0, float(icept))
    if slope < 0:       # flat or noisy: the mean is the best constant
        over = float(np.mean([itl[b] for b in bs]))
    points = sorted(ttft)
    y = np.array([ttft[p] for p in points])
    rest = y - np.array([steps(n - c, max_batched) * over for n, c in points])
    a = np.array([_ttft_terms(n, c) for n, c in points]) / y[:, None]
    req, per, ctx = _nnls(a, rest / y)
    return {"request_overhead_ms": round(float(req), 3), "step_overhead_ms": round(over, 3),
            "prefill_ms_per_token": round(float(per), 5), "prefill_ms_per_token_per_1k_ctx": round(float(ctx), 5),
            "decode_ms_base": 0.0, "decode_ms_per_seq": round(per_seq, 4)}

"""Prefill throughput of candidate tiny-model shapes, float32 vs bfloat16, native vs AVX2-capped.

    .venv/bin/python benchmarks/tiny_shapes.py            # both columns side by side (~3 min, 1 core)

Runs transformers' Llama forward (not vLLM) on one thread for a 1,000-token prompt, best of 3, so
shapes compare on equal terms. The "AVX2" column runs the same in a child process with the math
libraries capped at AVX2 (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY): an
approximation of an AVX2-only CPU on an AVX-512 one, good for ratios between shapes and dtypes, not
for absolute speed. Used to size kvlab's tiny model per dtype (docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SHAPES = [  # hidden, intermediate, layers, heads, kv heads
    (1024, 2816, 8, 16, 4), (768, 2048, 8, 12, 4), (512, 1536, 8, 8, 4), (512, 1408, 6, 8, 4)]
AVX2 = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2"}


def tokens_per_s(shape: tuple[int, ...], dtype: str, n: int = 1000) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    h, i, layers, heads, kv = shape
    cfg = LlamaConfig(vocab_size=2048, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    x = torch.randint(0, 2048, (1, n))
    with torch.no_grad():
        model(x[:, :64])
        best = min(_timed(model, x) for _ in range(3))
    return n / best


def _timed(model, x) -> float:
    t = time.perf_counter()
    model(x)
    return time.perf_counter() - t


def measure() -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    return {f"{s}|{d}": round(tokens_per_s(s, d)) for s in SHAPES for d in ("float32", "bfloat16")}


def main() -> int:
    if "--child" in sys.argv:
        print(json.dumps(measure()))
        return 0
    cols = {}
    for name, env in (("native", {}), ("AVX2-capped", AVX2)):
        out = subprocess.run([sys.executable, __file__, "--child"], env={**os.environ, **env}, check=True,
                             capture_output=True, text=True).stdout
        cols[name] = json.loads(out.strip().splitlines()[-1])
    print("| hidden / intermediate / layers / heads / kv | dtype | native tok/s | AVX2-capped tok/s |")
    print("|---|---|---:|---:|")
    for key in cols["native"]:
        shape, dtype = key.split("|")
        print(f"| {shape} | {dtype} | {cols['native'][key]} | {cols['AVX2-capped'][key]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

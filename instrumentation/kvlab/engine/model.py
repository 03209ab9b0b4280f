"""`kvlab model tiny --model-dir DIR`: a tiny Llama-architecture model for real vLLM on CPU.

No model can be downloaded here, so kvlab builds one: random weights (seeded, so the same flags
give the same files), kvlab's own tokenizer (or `--tokenizer DIR`) saved in by transformers, its chat
template in `chat_template.jinja`. Its outputs are
gibberish, but the compute, KV cache, prefix caching, metrics and KV events in vLLM are real.
The default size makes a 2,000-token prefill take one to two seconds on one CPU core, AVX2 or
AVX-512, so a prefix-cache hit is something a learner feels (docs/vllm.md has the measurements).
The dtype follows the CPU (`kvlab.doctor.choose_dtype`): bfloat16 only where vLLM has a fast bf16
path (AVX512-BF16, AMX), float32 elsewhere.

Two tweaks keep a random model well behaved: the residual stream carries a constant in
dimension 0 and the output rows of the special tokens (end-of-turn among them) read it with a
large negative weight, so the model never emits a special token. Every reply is exactly
`max_tokens` long and decodes to visible text, as with the simulator.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from kvlab import tokenizer as kvtok
from kvlab.doctor import DTYPES, choose_dtype, detect_isa
from kvlab.vocabulary import old_spelling


class TinySpec(msgspec.Struct, frozen=True, kw_only=True):
    """The model's shape; everything else follows from it and kvlab's tokenizer."""

    hidden_size: int = 512
    intermediate_size: int = 1536
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    max_position_embeddings: int = 8192
    dtype: str = "float32"       # fast everywhere; `tiny_spec()` picks bfloat16 (and its shape) where fast
    seed: int = 0


def resolve_dtype(requested: str = "auto") -> str:
    """`auto`: the dtype this CPU runs fast in vLLM (kvlab.doctor); anything else as given."""
    return requested if requested != "auto" else choose_dtype(detect_isa())[0]


# Per dtype, a shape that prefills ~1,000-1,500 tokens/s on one core of the CPUs that pick that dtype:
# bfloat16 (AVX512-BF16/AMX) keeps the shape the `cpu-tiny` profile was fitted on; float32 (AVX2)
# is ~1.8x cheaper per token (docs/vllm.md has the measurements and the reasoning).
SHAPES: dict[str, dict[str, int]] = {
    "bfloat16": {"hidden_size": 768, "intermediate_size": 2048, "num_heads": 12},
    "float32": {},
}


def tiny_spec(dtype: str = "auto", **shape: int) -> TinySpec:
    """The default shape for the dtype this machine runs fast (or the one asked for); `shape`
    overrides fields."""
    resolved = resolve_dtype(dtype)
    return msgspec.structs.replace(TinySpec(dtype=resolved), **{**SHAPES.get(resolved, {}), **shape})


SPEC_FILE = "kvlab_model.json"   # the spec a directory was built from (reuse check)


def build_tiny(out: str | Path, spec: TinySpec = TinySpec(), tokenizer_dir: str | Path | None = None) -> Path:
    """Write an HF model directory (config, safetensors weights, tokenizer files) to `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated

    tok_dir = Path(tokenizer_dir) if tokenizer_dir else kvtok.default_dir()
    tok = kvtok.Tokenizer(tok_dir)
    special = sorted(tok.special_ids)
    eos = tok.eos_token_id
    # named in transformers 4, still accepted by 5's dataclass config (which calls them rope_parameters and dtype)
    legacy: dict[str, Any] = {"rope_theta": 10000.0, "torch_dtype": spec.dtype}
    config = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tok.hf.bos_token_id,
        eos_token_id=eos,
        pad_token_id=eos,
        **legacy,
    )
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]  # transformers leaves __init__ unannotated
        model.model.embed_tokens.weight[:, 0] = 1.0          # constant in dimension 0 ...
        head = model.lm_head.weight
        head[:, 0] = 0.0
        head[special, 0] = -10.0                             # ... read by special tokens only
        model = model.to(getattr(torch, spec.dtype))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # saved by transformers, as a model on the Hub has it: the template in chat_template.jinja
    tok.hf.save_pretrained(str(out))
    (out / SPEC_FILE).write_text(json.dumps(msgspec.to_builtins(spec), indent=2) + "\n")
    return out


def ensure_tiny(out: str | Path, spec: TinySpec = TinySpec(), tokenizer_dir: str | Path | None = None) -> Path:
    """`out` holding a model built from `spec`: reused when it is there, built when not."""
    out = Path(out)
    spec_file = out / SPEC_FILE
    saved_by_transformers = (out / "tokenizer_config.json").is_file() and "chat_template" not in json.loads(
        (out / "tokenizer_config.json").read_text())
    if spec_file.is_file() and (out / "model.safetensors").is_file() and saved_by_transformers:
        try:
            if msgspec.json.decode(spec_file.read_bytes(), type=TinySpec) == spec:
                return out
        except msgspec.DecodeError:
            pass
    return build_tiny(out, spec, tokenizer_dir)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvlab model", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tiny", help="build the tiny random-weight Llama model into --model-dir")
    t.add_argument("--model-dir", help="directory to write (created; required)")
    old_spelling(t, "--out", "--model-dir")
    flags = {"hidden_size": "--hidden-size", "intermediate_size": "--intermediate-size", "num_layers": "--layers",
             "num_heads": "--heads", "num_kv_heads": "--kv-heads",
             "max_position_embeddings": "--max-position-embeddings", "seed": "--seed"}
    for field, flag in flags.items():
        t.add_argument(flag, dest=field, type=int, help="seed of the random weights (default 0)" if field == "seed"
                       else "default: the dtype's shape (docs/vllm.md)")
    t.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto: bfloat16 with AVX512-BF16/AMX, else float32 (`kvlab doctor`)")
    t.add_argument("--tokenizer", default=None, help="HF tokenizer dir (default: kvlab's own)")
    a = p.parse_args(argv)
    if a.model_dir is None:
        p.error("tiny: --model-dir DIR is required")
    spec = tiny_spec(a.dtype, **{f: getattr(a, f) for f in flags if getattr(a, f) is not None})
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        p.error("--hidden-size must be a multiple of --heads, and --heads of --kv-heads")
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        print("kvlab model: needs torch and transformers: `make vllm` (see docs/vllm.md)", file=sys.stderr)
        return 1
    start = time.perf_counter()
    out = build_tiny(a.model_dir, spec, a.tokenizer)
    print(f"tiny model ({spec.dtype}) written to {out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0

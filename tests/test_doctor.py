"""`kvlab doctor`: ISA detection from /proc/cpuinfo, the dtype it implies, and the --json schema;
the tiny model and the vLLM launcher follow that dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import pytest

from kvlab import doctor
from kvlab.engine import model
from kvlab.engine import vllm as launcher

# abridged /proc/cpuinfo of three machine kinds (two CPUs each; only the first is read)
FLAGS = {
    "avx2": "fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2",
    "avx512": "fpu sse2 avx avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni",
    "avx512_bf16": "fpu sse2 avx avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_vp2intersect",
    "amx": "fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8",
    "none": "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx",
}


def cpuinfo(tmp_path, level: str, model_name: str = "AMD EPYC 7B12"):
    cpu = f"processor\t: {{n}}\nvendor_id\t: AuthenticAMD\nmodel name\t: {model_name}\nflags\t\t: {FLAGS[level]}\n\n"
    path = tmp_path / f"cpuinfo-{level}"
    path.write_text(cpu.format(n=0) + cpu.format(n=1))
    return path


@pytest.fixture(autouse=True)
def no_forced_isa(monkeypatch):
    monkeypatch.delenv("KVLAB_ISA", raising=False)


@pytest.mark.parametrize(("level", "flags", "dtype"), [
    ("none", (False, False, False, False), "float32"),
    ("avx2", (True, False, False, False), "float32"),
    ("avx512", (True, True, False, False), "float32"),
    ("avx512_bf16", (True, True, True, False), "bfloat16"),
    ("amx", (True, True, True, True), "bfloat16"),
])
def test_isa_from_cpuinfo_and_the_dtype_it_implies(tmp_path, level, flags, dtype):
    isa = doctor.detect_isa(cpuinfo(tmp_path, level))
    assert (isa.avx2, isa.avx512, isa.avx512_bf16, isa.amx) == flags
    assert isa.level == level and isa.source.endswith(f"cpuinfo-{level}")
    assert doctor.choose_dtype(isa)[0] == dtype
    assert doctor.choose_dtype(isa, "bfloat16") == ("bfloat16", "--dtype")     # --dtype overrides


def test_forcing_a_level(tmp_path, monkeypatch):
    path = cpuinfo(tmp_path, "amx")
    monkeypatch.setenv("KVLAB_ISA", "avx2")
    isa = doctor.detect_isa(path)
    assert (isa.level, isa.avx512, isa.source) == ("avx2", False, "KVLAB_ISA=avx2")
    assert doctor.detect_isa(path, forced="avx512_bf16").level == "avx512_bf16"     # --isa beats the env
    monkeypatch.setenv("KVLAB_ISA", "avx3")
    with pytest.raises(doctor.ConfigError, match="KVLAB_ISA=avx3"):
        doctor.detect_isa(path)


def test_missing_cpuinfo_means_no_level(tmp_path):
    isa = doctor.detect_isa(tmp_path / "absent")
    assert isa.level == "none" and "unreadable" in isa.source


def test_model_and_launcher_follow_the_isa(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_ISA", "avx2")
    assert (model.tiny_spec().dtype, model.tiny_spec().hidden_size) == ("float32", 512)
    a = launcher.parser().parse_args([])
    a.extra = []
    argv = launcher.build_specs(a, tmp_path, {})[0].argv
    assert argv[argv.index("--dtype") + 1] == "float32"
    monkeypatch.setenv("KVLAB_ISA", "avx512_bf16")
    assert (model.tiny_spec().dtype, model.tiny_spec().hidden_size) == ("bfloat16", 768)   # cpu-tiny's shape
    assert model.tiny_spec("float32", num_layers=6).num_layers == 6
    argv = launcher.build_specs(a, tmp_path, {})[0].argv
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    a = launcher.parser().parse_args(["--dtype", "float32"])
    a.extra = []
    assert launcher.build_specs(a, tmp_path, {})[0].argv.count("float32") == 1
    # a model built for another dtype lives in another directory (never reused by mistake)
    assert launcher.default_model_dir(None, model.tiny_spec("float32")) != \
        launcher.default_model_dir(None, model.tiny_spec("bfloat16"))


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.processes
def test_json_matches_its_schema_and_the_fake_machine(tmp_path):
    schema = json.loads(_doctor("--schema").stdout)
    fake = cpuinfo(tmp_path, "avx2", "Fake EPYC")
    out = _doctor("--json", "--cpuinfo", str(fake), env={"KVLAB_ISA": ""})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    jsonschema.validate(report, schema)
    assert report["schema"] == doctor.SCHEMA_VERSION
    assert report["cpu"]["model"] == "Fake EPYC" and report["cpu"]["isa"]["level"] == "avx2"
    assert report["cpu"]["cores"] == len(os.sched_getaffinity(0))
    assert report["choices"]["dtype"] == "float32" and "AVX512-BF16" in report["choices"]["dtype_reason"]
    assert set(report["parts"]) == {"vllm", "torch", "prometheus", "chromium", "jaeger", "kubectl", "kind", "docker"}
    assert any("float32" in line for line in report["advice"])
    # the schema is strict enough to catch a wrong field
    report["cpu"]["isa"]["level"] = "sse"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(report, schema)
    forced = json.loads(_doctor("--json", "--cpuinfo", str(fake), "--isa", "amx").stdout)
    assert forced["choices"]["dtype"] == "bfloat16" and forced["cpu"]["isa"]["source"] == "--isa amx"


@pytest.mark.processes
def test_table_and_bad_level():
    out = _doctor("--isa", "avx2")
    assert out.returncode == 0 and "the lab will use" in out.stdout and "float32" in out.stdout
    bad = _doctor(env={"KVLAB_ISA": "sse9"})
    assert bad.returncode == 2 and "KVLAB_ISA=sse9" in bad.stderr


def test_preflight_stops_a_vllm_lab_without_vllm(monkeypatch):
    from rich.console import Console

    parts = doctor.find_parts()
    monkeypatch.setattr(doctor, "find_parts", lambda: {**parts, "vllm": doctor.Part(installed=False)})
    console = Console(record=True, width=200)
    report = doctor.preflight(console, "sim")             # the simulator needs no vLLM
    text = console.export_text()
    assert report.choices.engine == "sim" and "sim engine" in text and "dtype" not in text   # no vLLM dtype to pick
    with pytest.raises(doctor.ConfigError, match="make vllm"):
        doctor.preflight(console, "vllm")

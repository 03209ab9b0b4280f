"""A real Prometheus server for the local stack, scraping the replicas and the gateway.

`start_prometheus` writes `run_dir/prometheus/prometheus.yml` (short scrape interval so a lab of a
minute or two still has dense series), keeps its TSDB under `run_dir/prometheus/data`, listens on
loopback only and returns once `/-/ready` answers. Exemplar storage is on, so latency histograms
that carry trace-id exemplars link to traces in Grafana. No binary → None (the lab still runs;
dashboards then need a Prometheus of the user's own).

The lab's recording and alerting rules (`kvlab.dashboards.rules`, the same text as
dashboards/rules/kvlab.rules.yaml) are written beside the config and evaluated every scrape
interval; `/api/v1/alerts` lists the firing ones (docs/observability.md#alerts).

Targets are file-based service discovery (`file_sd_configs`): one JSON file per job under
`run_dir/prometheus/targets/`, which `write_targets` rewrites atomically when the stack adds or
removes a replica (the autoscaling scenario); Prometheus notices the change without a reload.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from kvlab.dashboards import rules
from kvlab.errors import StackError
from kvlab.process import Child

STARTUP_TIMEOUT_S = 30.0
SD_REFRESH = "1s"    # file_sd re-reads at least this often (besides inotify)


def _duration(seconds: float) -> str:
    """Prometheus duration text: whole milliseconds ("1s", "250ms")."""
    ms = max(1, round(seconds * 1000))
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def targets_file(run_dir: Path, job: str) -> Path:
    """The file_sd targets file of `job` under the run dir."""
    return Path(run_dir).absolute() / "prometheus" / "targets" / f"{job}.json"


def write_targets(run_dir: Path, job: str, addrs: list[str]) -> Path:
    """(Re)write `job`'s targets (["host:port", ...]) atomically; Prometheus follows without a reload."""
    path = targets_file(run_dir, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps([{"targets": list(addrs), "labels": {}}]) + "\n")
    tmp.replace(path)
    return path


def rules_file(run_dir: Path) -> Path:
    """The lab's recording and alerting rules (kvlab.dashboards.rules), as this Prometheus loads them."""
    return Path(run_dir).absolute() / "prometheus" / "kvlab.rules.yaml"


def scrape_config(jobs: list[str], run_dir: Path, scrape_interval_s: float = 1.0) -> dict[str, Any]:
    """The prometheus.yml content: one job per name, its targets read from its file_sd file, and
    the lab's rules evaluated every scrape interval."""
    interval = _duration(scrape_interval_s)
    timeout = _duration(min(scrape_interval_s, 10.0) * 0.9)
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": timeout, "evaluation_interval": interval},
        "rule_files": [str(rules_file(run_dir))],
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics",
             "file_sd_configs": [{"files": [str(targets_file(run_dir, job))], "refresh_interval": SD_REFRESH}]}
            for job in jobs
        ],
    }


def start_prometheus(run_dir: Path, targets: dict[str, list[str]], port: int,
                     scrape_interval_s: float = 1.0) -> Child | None:
    """Start Prometheus on 127.0.0.1:`port` scraping `targets`; None when the binary is absent.

    `targets` are the initial ones (job -> ["host:port", ...]); change a job's later with
    `write_targets(run_dir, job, addrs)`.

    The caller owns the process: stop it with `stop()`. Its log is
    `run_dir/prometheus/prometheus.log`. StackError if it exits or is not ready in time.
    """
    binary = shutil.which("prometheus")
    if binary is None:
        return None
    home = Path(run_dir) / "prometheus"
    (home / "data").mkdir(parents=True, exist_ok=True)
    for job, addrs in targets.items():
        write_targets(run_dir, job, addrs)
    rules_file(run_dir).write_text(rules.render())
    config = home / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(list(targets), run_dir, scrape_interval_s), sort_keys=False))
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={home / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=7d",
        "--enable-feature=exemplar-storage",
        "--web.enable-lifecycle",
    ]
    child = Child.start("prometheus", argv, home / "prometheus.log")
    try:
        child.wait_http(f"http://127.0.0.1:{port}/-/ready", STARTUP_TIMEOUT_S)
    except StackError:
        child.stop()
        raise
    return child


def active_targets(base_url: str) -> list[dict[str, Any]]:
    """Prometheus's view of its scrape targets (job, instance, health, lastError)."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/api/v1/targets?state=active", timeout=5) as resp:
        data = json.load(resp)
    return [{"job": t["labels"].get("job"), "instance": t["labels"].get("instance"),
             "health": t.get("health"), "lastError": t.get("lastError", "")}
            for t in data["data"]["activeTargets"]]

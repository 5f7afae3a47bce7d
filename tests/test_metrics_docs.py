"""docs/metrics.md, the Grafana dashboard and the scrape config name exactly the real series."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kvstore import metrics
from kvstore.frontend import metrics as serve_metrics

ROOT = Path(__file__).resolve().parent.parent


def exposed_names() -> set[str]:
    """Every series name as a scrape shows it (counters with ``_total``): the store's and the
    HTTP front end's registries."""
    names = set()
    for registry in (metrics.REGISTRY, serve_metrics.REGISTRY):
        for family in registry.collect():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_docs_list_every_series_and_no_other() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(kvstore_[a-z_]+)` \|", text, flags=re.M))
    assert documented == exposed_names()


def test_dashboard_queries_only_existing_series() -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "kvstore-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", n)
            for e in exprs for n in re.findall(r"kvstore_[a-z_]+", e)}
    assert used and used <= exposed_names()
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("hit rate", "per path", "p99", "pool use", "evictions by cause"):
        assert topic in titles


def test_scrape_config_has_a_job_per_kind_of_endpoint() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvstore-store-nodes", "kvstore-coordinator", "kvstore-serve"}
    for job in jobs.values():
        for target in job["static_configs"][0]["targets"]:
            assert re.fullmatch(r"[A-Z0-9_]+:\d+", target)

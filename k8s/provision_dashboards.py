"""Provision the Grafana dashboards of k8s/dashboards/ through the Grafana HTTP API (grafana-client).

    GRAFANA_URL=https://grafana.example.com GRAFANA_TOKEN=glsa_... make dashboards
    python k8s/provision_dashboards.py [--folder specserve] [--dashboards k8s/dashboards] [--dry-run]

GRAFANA_URL is the Grafana base URL (credentials may be embedded: http://admin:admin@localhost:3000);
GRAFANA_TOKEN a service-account token with the Editor role (or none, with credentials in the URL).
Every *.json in the dashboards directory is uploaded into the folder (created if missing), replacing
the dashboard with the same uid: re-running is safe. The dashboards pick their Prometheus data
source through a `datasource` variable, so nothing here depends on the data source's uid.

Also importable (tests/test_k8s.py, tests/test_loadtest.py): dashboard_exprs() lists every PromQL
expression of a dashboard, promql_metric_names() the metric names one expression reads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent

# ---- PromQL ------------------------------------------------------------------------------------

_FUNCTIONS_AND_KEYWORDS = {
    # aggregation operators and their modifiers, set operators, other keywords
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
    "limitk", "limit_ratio", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "atan2", "inf", "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression reads (a light lexer: enough for dashboard queries, not a parser).

    Strings, label matchers {...}, ranges/subsquares [...], grouping lists `by (...)`, numbers,
    function calls, keywords and Grafana variables are removed; what remains are metric names.
    `label_values(metric, label)` (a Grafana variable query) yields `metric`.
    """
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)\s*", expr)
    if m:
        return {m.group(1)}
    if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}") or expr.count("[") != expr.count("]"):
        raise ValueError(f"unbalanced brackets in {expr!r}")
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\[\]]*\]", " ", s)  # range selectors and subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", s)  # label lists
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # Grafana variables ($__rate_interval, ${datasource})
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _FUNCTIONS_AND_KEYWORDS:
            continue
        names.add(word)
    return names


def dashboard_exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets (rows included) and query variables."""
    exprs = []

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))  # collapsed rows hold their panels

    for p in panels(dashboard.get("panels", [])):
        exprs += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            exprs.append(q.get("query") if isinstance(q, dict) else q)
    return exprs


def load_dashboards(directory: str | Path = HERE / "dashboards") -> dict[str, dict]:
    """{file name: dashboard JSON} of every *.json in directory."""
    out = {}
    for path in sorted(Path(directory).glob("*.json")):
        dash = json.loads(path.read_text())
        if not dash.get("uid") or not dash.get("title"):
            raise ValueError(f"{path}: a dashboard needs a uid and a title")
        out[path.name] = dash
    if not out:
        raise ValueError(f"no dashboards in {directory}")
    return out


# ---- Grafana -----------------------------------------------------------------------------------

def provision(api, dashboards: dict[str, dict], folder_title: str, folder_uid: str) -> list[dict]:
    """Create the folder if needed and upload every dashboard into it (overwriting by uid)."""
    from grafana_client.client import GrafanaClientError

    try:
        api.folder.get_folder(folder_uid)
    except GrafanaClientError as e:
        if getattr(e, "status_code", None) != 404:
            raise
        api.folder.create_folder(folder_title, uid=folder_uid)
    results = []
    for name, dash in dashboards.items():
        body = {"dashboard": {**dash, "id": None}, "folderUid": folder_uid, "overwrite": True,
                "message": f"provisioned from k8s/dashboards/{name} by make dashboards"}
        results.append(api.dashboard.update_dashboard(body))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="provision_dashboards", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=os.environ.get("GRAFANA_URL"), help="Grafana base URL (default $GRAFANA_URL)")
    p.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"), help="API token (default $GRAFANA_TOKEN)")
    p.add_argument("--folder", default="specserve", help="folder title (its uid is the title, lower-cased)")
    p.add_argument("--dashboards", default=str(HERE / "dashboards"), help="directory of dashboard JSON files")
    p.add_argument("--dry-run", action="store_true", help="only check the dashboards, upload nothing")
    a = p.parse_args(argv)
    try:
        dashboards = load_dashboards(a.dashboards)
        for name, dash in dashboards.items():
            for expr in dashboard_exprs(dash):
                promql_metric_names(expr)  # raises on unbalanced brackets
    except (OSError, ValueError) as e:
        print(f"dashboards: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        print(f"dashboards: {', '.join(dashboards)} ok (dry run, nothing uploaded)")
        return 0
    if not a.url:
        print("dashboards: set GRAFANA_URL (and GRAFANA_TOKEN), e.g. make dashboards GRAFANA_URL=http://localhost:3000 "
              "GRAFANA_TOKEN=...", file=sys.stderr)
        return 2
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaException

    api = GrafanaApi.from_url(url=a.url, credential=a.token or None)
    folder_uid = re.sub(r"[^a-z0-9_-]", "-", a.folder.lower())
    try:
        results = provision(api, dashboards, a.folder, folder_uid)
    except (GrafanaException, OSError) as e:
        print(f"dashboards: Grafana at {a.url}: {e}", file=sys.stderr)
        return 1
    u = urlparse(a.url)
    base = u._replace(netloc=u.hostname + (f":{u.port}" if u.port else ""), query="").geturl().rstrip("/")  # no password
    for r in results:
        print(f"dashboards: {r.get('status', 'ok')} {base}{r.get('url', '')} (version {r.get('version')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A JSON Schema for the parts of Grafana's dashboard model kvlab relies on, checked on top of the
typed builder: unique panel ids, grid inside 24 columns, every query a non-empty PromQL against a
provisioned datasource, unique refIds per panel."""

from __future__ import annotations

from typing import Any

import jsonschema

from kvlab.dashboards.panels import JAEGER_UID, PROMETHEUS_UID

_GRID = {
    "type": "object", "required": ["h", "w", "x", "y"],
    "properties": {"h": {"type": "integer", "minimum": 1}, "w": {"type": "integer", "minimum": 1, "maximum": 24},
                   "x": {"type": "integer", "minimum": 0, "maximum": 23}, "y": {"type": "integer", "minimum": 0}},
}
_DATASOURCE = {"type": "object", "required": ["uid"],
               "properties": {"uid": {"enum": [PROMETHEUS_UID, JAEGER_UID]}}}
_TARGET = {
    "type": "object", "required": ["expr", "refId"],
    "properties": {"expr": {"type": "string", "minLength": 3}, "refId": {"type": "string", "pattern": "^[A-Z]$"},
                   "legendFormat": {"type": "string"}, "exemplar": {"type": "boolean"}},
}
_PANEL = {
    "type": "object", "required": ["id", "type", "title", "gridPos", "datasource", "targets"],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "type": {"enum": ["timeseries", "stat", "table", "bargauge", "heatmap"]},
        "title": {"type": "string", "minLength": 1},
        "gridPos": _GRID, "datasource": _DATASOURCE,
        "targets": {"type": "array", "minItems": 1, "items": _TARGET},
        "options": {"type": "object"},
        "fieldConfig": {"type": "object", "required": ["defaults"]},
    },
}
_ROW = {
    "type": "object", "required": ["id", "type", "title", "gridPos", "panels"],
    "properties": {"id": {"type": "integer", "minimum": 1}, "type": {"const": "row"},
                   "title": {"type": "string", "minLength": 1}, "gridPos": _GRID,
                   "panels": {"type": "array", "items": _PANEL}},
}
DASHBOARD_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["uid", "title", "panels", "schemaVersion", "time", "refresh"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-z0-9-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "tags": {"type": "array", "items": {"type": "string"}},
        "panels": {"type": "array", "minItems": 1,
                   "items": {"if": {"properties": {"type": {"const": "row"}}}, "then": _ROW, "else": _PANEL}},
    },
}


def validate(data: dict[str, Any]) -> None:
    """Raise ValueError naming the first problem of a dashboard's JSON."""
    try:
        jsonschema.validate(data, DASHBOARD_SCHEMA)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"dashboard {data.get('uid')!r}: {exc.message} at /{where}") from None
    ids: list[int] = []
    for p in data["panels"]:
        ids.append(p["id"])
        ids += [c["id"] for c in p.get("panels") or []]
        for panel in [p, *(p.get("panels") or [])]:
            refs = [t["refId"] for t in panel.get("targets") or []]
            if len(refs) != len(set(refs)):
                raise ValueError(f"dashboard {data['uid']!r}: duplicate refId in panel {panel['title']!r}")
    if len(ids) != len(set(ids)):
        raise ValueError(f"dashboard {data['uid']!r}: duplicate panel ids")

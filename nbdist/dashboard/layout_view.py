"""The rank layout as a tree (coordinator, groups, folds, masters, workers), coloured by role.

It is drawn from `Layout.to_dict()` as stored with the run, so a past run shows the
layout it ran with.
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["layout_html", "ROLE_COLORS"]

ROLE_COLORS = {
    "coordinator": "#9467bd",
    "group": "#7f7f7f",
    "fold": "#bcbd22",
    "master": "#ff7f0e",
    "worker": "#1f77b4",
}


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return ""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
    return f"ranks {ranks[0]}-{ranks[-1]}" if contiguous else "ranks " + ", ".join(map(str, ranks))


def _label(node: dict[str, Any]) -> str:
    kind = node["kind"]
    if kind == "coordinator":
        return "coordinator"
    if kind == "master":
        return f"{'top ' if node.get('top') and node.get('index', 0) == 0 else ''}master {node['index']}"
    if kind == "worker" and len(node["ranks"]) > 1:
        return f"worker {node['index']} ({len(node['ranks'])} processes)"
    return f"{kind} {node.get('index', '')}".strip()


def _node(node: dict[str, Any]) -> str:
    color = ROLE_COLORS.get(node["kind"], "#333")
    badge = (
        f'<span class="nbdist-role nbdist-role-{node["kind"]}" style="background:{color};color:white;'
        f'border-radius:3px;padding:0 5px;margin-right:6px">{html.escape(_label(node))}</span>'
    )
    children = "".join(_node(c) for c in node.get("children", []))
    inner = f"<ul style='list-style:none;padding-left:18px;margin:2px 0'>{children}</ul>" if children else ""
    return f"<li>{badge}<span style='color:#555'>{_ranks(node.get('ranks', []))}</span>{inner}</li>"


def layout_html(layout: dict[str, Any]) -> str:
    """HTML for a stored layout (empty layouts say so)."""
    if not layout or "nodes" not in layout:
        return "<i>no layout recorded for this run</i>"
    title = html.escape(f"{layout['options'].get('topology', '')} layout, {layout.get('describe', '')}")
    nodes = "".join(_node(n) for n in layout["nodes"])
    return (
        f"<div class='nbdist-layout' style='font-family:monospace;font-size:12px'><b>{title}</b>"
        f"<ul style='list-style:none;padding-left:0;margin:4px 0'>{nodes}</ul></div>"
    )

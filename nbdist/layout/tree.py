"""A layout as a tree: its nodes as plain data (Layout.to_dict) and drawn as text
(Layout.tree), and the phrases its messages use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from nbdist.layout.core import Layout

__all__ = ["ranks_text", "plural", "layout_nodes", "draw_tree"]


def plural(count: int | str, word: str) -> str:
    # `count` may be the symbol "W" in messages about the worker count to choose.
    if str(count) == "1":
        return f"1 {word}"
    return f"{count} {word}es" if word.endswith("s") else f"{count} {word}s"


def ranks_text(ranks: list[int]) -> str:
    """'rank 3', 'ranks 3-5' or 'ranks 1, 4'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def layout_nodes(layout: Layout) -> list[dict[str, Any]]:
    """The nodes of Layout.to_dict: the coordinator, then group by group (see there)."""
    nodes: list[dict[str, Any]] = []
    if layout.coordinator:
        nodes.append({"kind": "coordinator", "rank": 0, "ranks": [0], "children": []})

    def worker_nodes(ranks: list[int]) -> list[dict[str, Any]]:
        p = layout.procs_per_worker
        return [
            {
                "kind": "worker",
                "index": w,
                "rank": ranks[w * p],
                "ranks": ranks[w * p : (w + 1) * p],
                "children": [],
            }
            for w in range(len(ranks) // p)
        ]

    for g in range(layout.groups):
        folds: list[dict[str, Any]] = []
        for f in range(layout.folds):
            ranks = layout.fold_ranks(g, f)
            if layout.topology == "allreduce":
                children = worker_nodes(ranks)
            else:
                per_master = len(ranks) // layout.masters
                children = []
                for m in range(layout.masters):
                    own = ranks[m * per_master : (m + 1) * per_master]
                    children.append(
                        {
                            "kind": "master",
                            "index": m,
                            "top": m == 0,
                            "rank": own[0],
                            "ranks": own,
                            "children": worker_nodes(own[1:]),
                        }
                    )
            folds.append({"kind": "fold", "index": f, "ranks": ranks, "children": children})
        nodes.append(
            {"kind": "group", "index": g, "ranks": [r for fold in folds for r in fold["ranks"]], "children": folds}
        )
    return nodes


def draw_tree(layout: Layout) -> str:
    """Layout.tree's text; group and fold levels of count 1 are folded into one line."""
    lines = [f"{layout.topology} layout, {layout.describe()}"]

    def label(node: dict[str, Any]) -> str:
        kind = node["kind"]
        if kind == "coordinator":
            return "coordinator"
        text = f"{kind} {node['index']}"
        if kind == "master" and layout.masters > 1:
            text += " [top master]" if node["top"] else " [sub-master]"
        return text

    def draw(node: dict[str, Any], text: str, prefix: str, branch: str, below: str) -> None:
        # A master's line shows its own rank; its workers show theirs below it.
        ranks = [node["rank"]] if node["kind"] == "master" else node["ranks"]
        lines.append(f"{prefix}{branch}{text}  {ranks_text(ranks)}")
        kids = node["children"]
        for i, kid in enumerate(kids):
            last = i == len(kids) - 1
            draw(kid, label(kid), prefix + below, "└── " if last else "├── ", "    " if last else "│   ")

    for node in layout.to_dict()["nodes"]:
        if node["kind"] == "coordinator":
            draw(node, label(node), "", "", "")
            continue
        g = node["index"]
        if layout.groups == 1:
            # One group: its folds are the roots.
            for fold in node["children"]:
                draw(fold, f"fold {fold['index']} (group {g})", "", "", "")
        elif layout.folds == 1:
            fold = node["children"][0]
            draw({**node, "children": fold["children"]}, f"group {g} (fold 0)", "", "", "")
        else:
            draw(node, f"group {g}", "", "", "")
    return "\n".join(lines)

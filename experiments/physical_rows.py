"""The rows of `experiments/reconstruct_ab.py`'s results, as its JSON holds them: one row a
setting and budget (``"NAME, B%"``), prompts answered right, kept tokens and physical
memory summed over prompts with each prompt's own entry; the peer's runs among them; and
the rows at equal physical memory matched from those runs. Plain Python, no torch: what
`experiments/pool_runs.py` needs without loading a model's libraries.
"""

from __future__ import annotations


def new_row() -> dict:
    return {"right": 0, "prompts": 0, "stored": 0, "wrong": []}


def add_result(row: dict, label: str, right: bool, stored: int, physical: int | None) -> None:
    """One prompt's result in a row: counts, sums and the prompt's own entry."""
    row["right"] += right
    row["prompts"] += 1
    row["stored"] += stored
    if not right:
        row["wrong"].append(label)
    if physical is not None:
        row["physical"] = row.get("physical", 0) + physical
    row.setdefault("per_prompt", {})[label] = {
        "right": right, "stored": stored, "physical": physical,
    }  # fmt: skip


def peer_runs(rows: dict) -> dict[str, dict]:
    """The peer presses' own runs among `rows`, `{NAME: {"kvpress NAME, B%": row}}` in
    the rows' order: not ours, and not the rows `equal_physical_rows` matched from them
    (``"kvpress NAME at ...``: a press's name has no space)."""
    out: dict[str, dict] = {}
    for key, row in rows.items():
        name, sep, _ = key.removeprefix("kvpress ").partition(", ")
        if key.startswith("kvpress ") and sep and " " not in name:
            out.setdefault(name, {})[key] = row
    return out


def matched_keys(rows: dict) -> set[str]:
    """The names of the rows `equal_physical_rows` made among `rows` (a peer's rows that
    are not its runs)."""
    runs = {k for per_press in peer_runs(rows).values() for k in per_press}
    return {k for k in rows if k.startswith("kvpress ")} - runs


def equal_physical_rows(rows: dict, ours: str, budgets, names) -> dict:
    """For each peer press and budget: per prompt, the press's run (of the budget and
    its sweep) with the most physical memory that is still at most our setting `ours`'s
    on that prompt at that budget (its smallest run where none is, counted in `over`);
    one row each, `"kvpress NAME at OURS's physical memory, B%"`, whose `budgets` name
    the run picked per prompt."""
    out = {}
    by_press = peer_runs(rows)
    for name in names:
        runs = by_press.get(name, {})
        for budget in budgets:
            mine = rows.get(f"{ours}, {100 * budget:g}%", {}).get("per_prompt", {})
            row = new_row() | {"budgets": {}}
            for label, me in mine.items():
                tried = [
                    r["per_prompt"][label] | {"run": k}
                    for k, r in runs.items()
                    if (r.get("per_prompt", {}).get(label) or {}).get("physical") is not None
                ]
                if not tried or me["physical"] is None:
                    continue
                fits = [t for t in tried if t["physical"] <= me["physical"]] or [
                    min(tried, key=lambda t: t["physical"])
                ]
                pick = max(fits, key=lambda t: t["physical"])
                add_result(row, label, pick["right"], pick["stored"], pick["physical"])
                row["budgets"][label] = pick["run"]
                row["over"] = row.get("over", 0) + (pick["physical"] > me["physical"])
            out[f"kvpress {name} at {ours}'s physical memory, {100 * budget:g}%"] = row
    return out

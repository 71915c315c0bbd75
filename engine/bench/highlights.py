"""The comparison the README and the Benchmarks view lead with: ours against llama.cpp on the same
GGUF, on one PC and on two, at 1, 4 and 8 users, taken from three ``fleet bench`` reports.

- one PC: ``fleet bench serve --llamacpp`` (both servers behind their HTTP APIs, on the whole PC);
  at 1 user llama.cpp's better configuration, with its draft model or without, where the report has both;
- two PCs, one user: ``fleet bench sim --parts ranks``: what the fleet itself deploys for one user,
  against llama.cpp whole on one of the two PCs (the better of with its draft model and without);
- two PCs, several users: ``fleet bench sim --parts office``: the better of our two layouts (a chain
  split over both PCs, or a copy on each), against the better of llama.cpp's (its RPC split, or a
  copy on each behind a round robin).

``collect`` builds the document from the reports; ``write`` publishes it as ``resources/highlights.json``,
which the Benchmarks view shows and a test checks against the reports it names and the README.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.bench.sim.office import LLAMA_ONE, LLAMA_REPLICAS, LLAMA_SPLIT, OURS_REPLICAS, OURS_SPLIT
from engine.bench.serve import LLAMA_DRAFT
from engine.bench.sim.ranks import FLEET, LLAMA_ONE_DRAFT

USERS = (1, 4, 8)
PUBLISHED = Path("resources") / "highlights.json"  # under the checkout (the app's resources folder)


def _tok(report: dict, server: str, users: int) -> float:
    for row in report["rows"]:
        if row.get("server") == server and row.get("users") == users and row.get("part", "users") == "users":
            return row["tok_s"]
    raise KeyError(f"{report['bench']} report has no row for {server!r} at {users} user(s)")


def _better(report: dict, servers: tuple[str, ...], users: int) -> tuple[str, float]:
    return max(((s, _tok(report, s, users)) for s in servers), key=lambda pair: pair[1])


def _better_of_present(report: dict, server: str, also: str, users: int) -> tuple[str, float]:
    """``server``'s figure, or ``also``'s where the report has that row too and it is the faster (a
    configuration measured only by newer reports: llama.cpp with its draft model)."""
    try:
        return _better(report, (server, also), users)
    except KeyError:
        return server, _tok(report, server, users)


def collect(serve: Path, ranks: Path, office: Path, *, root: Path) -> dict:
    """The document from the three reports (paths under ``root``, named relative to it)."""
    docs = {name: json.loads((root / path).read_text()) for name, path in
            (("serve", serve), ("ranks", ranks), ("office", office))}
    rows = []
    for users in USERS:
        peer, peer_tok = _better_of_present(docs["serve"], "llama.cpp", LLAMA_DRAFT, users)
        rows.append({"pcs": 1, "users": users, "ours": "fleet serve",
                     "ours_tok_s": _tok(docs["serve"], "fleet serve", users), "peer": peer,
                     "peer_tok_s": peer_tok, "report": str(serve)})
    peer, peer_tok = _better_of_present(docs["ranks"], LLAMA_ONE, LLAMA_ONE_DRAFT, 1)
    rows.append({"pcs": 2, "users": 1, "ours": FLEET, "ours_tok_s": _tok(docs["ranks"], FLEET, 1),
                 "peer": peer, "peer_tok_s": peer_tok, "report": str(ranks)})
    for users in USERS[1:]:
        ours, ours_tok = _better(docs["office"], (OURS_SPLIT, OURS_REPLICAS), users)
        peer, peer_tok = _better(docs["office"], (LLAMA_SPLIT, LLAMA_REPLICAS), users)
        rows.append({"pcs": 2, "users": users, "ours": ours, "ours_tok_s": ours_tok, "peer": peer,
                     "peer_tok_s": peer_tok, "report": str(office)})
    cores = docs["serve"]["machine"]["logical_cores"]
    for row in rows:  # the serve bench has the whole machine; the simulated PCs a core each
        row["setup"] = f"1 PC of {cores} cores, through the API" if row["pcs"] == 1 else \
            "2 simulated PCs of 1 core each, 1 Gbit/s"
        row["ratio"] = round(row["ours_tok_s"] / row["peer_tok_s"], 2)
    machine = docs["serve"]["machine"]
    return {"model": docs["serve"]["settings"]["model"], "date": machine["date"], "cpu": machine["cpu"],
            "int8_dot": machine["int8_dot"],
            "reports": {"serve": str(serve), "ranks": str(ranks), "office": str(office)}, "rows": rows}


def write(serve: Path, ranks: Path, office: Path, *, root: Path) -> dict:
    """Collects the document and writes it where the app reads it (``PUBLISHED`` under ``root``)."""
    doc = collect(serve, ranks, office, root=root)
    (root / PUBLISHED).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def markdown(doc: dict) -> str:
    """The table the README shows."""
    lines = ["| PCs | users | ours, tok/s | llama.cpp, tok/s | ours / llama.cpp |", "|---|---|---|---|---|"]
    for row in doc["rows"]:
        lines.append(f"| {row['setup']} | {row['users']} | {row['ours_tok_s']:g} ({row['ours']}) | "
                     f"{row['peer_tok_s']:g} ({row['peer']}) | **{row['ratio']:.2f}×** |")
    return "\n".join(lines)

"""How well retrieval finds the passage that answers a question, on the question set shipped in
``eval/``: twelve short office documents and ``questions.json`` (each question with the file and a phrase
of the passage that answers it, most worded unlike the passage).

``recall@k`` is the share of questions for which one of the ``k`` best passages is from the right file
and holds the answer phrase.  ``fleet bench docs`` reports it (``engine.bench.docs``); the tests hold
it above a floor.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from engine.documents.collection import Library

EVAL = Path(__file__).resolve().parent / "eval"
KS = (1, 3, 5)


def questions(folder: Path = EVAL) -> list[dict]:
    return json.loads((folder / "questions.json").read_text(encoding="utf-8"))


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def measure(folder: Path = EVAL, ks: tuple[int, ...] = KS, root: Path | None = None) -> dict:
    """{"questions", "passages", "recall@K" for each K, "misses": questions not found in the top max(K)}:
    the shipped documents indexed in a scratch collection (in ``root``, else a temporary folder)."""
    with tempfile.TemporaryDirectory(prefix="fleetshard-docs-eval-") as scratch:
        collection = Library(Path(root or scratch)).create("question set")
        collection.add(*sorted(p for p in folder.iterdir() if p.name != "questions.json"))
        collection.update()
        asked = questions(folder)
        ranks = []
        for q in asked:
            hits = collection.search(q["question"], k=max(ks))
            rank = next((n for n, hit in enumerate(hits, 1) if Path(hit.passage.file).name == q["file"]
                         and _normal(q["answer"]) in _normal(hit.passage.text)), None)
            ranks.append(rank)
        result = {"questions": len(asked), "passages": len(collection.passages)}
        for k in ks:
            result[f"recall@{k}"] = sum(1 for r in ranks if r is not None and r <= k) / len(asked)
        result["misses"] = [q["question"] for q, r in zip(asked, ranks) if r is None]
        return result

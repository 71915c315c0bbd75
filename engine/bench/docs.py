"""``fleet bench docs``: how often document search finds the passage that answers a question, on the
question set shipped with ``engine.documents`` (recall@1, @3, @5 of BM25; no embedding model is
measured because none is shipped or downloaded)."""

from __future__ import annotations

from pathlib import Path

from engine.bench.report import write_report
from engine.documents.recall import KS, measure


def run_docs(*, out: Path | None = None, log=print) -> dict:
    result = measure()
    log(f"{result['questions']} questions over {result['passages']} passages")
    for question in result["misses"]:
        log(f"not found in the top {max(KS)}: {question}")
    rows = [{"retriever": "bm25", "k": k, "recall": result[f"recall@{k}"], "questions": result["questions"]}
            for k in KS]
    return write_report("docs", rows, {f"bm25 recall@{k}": result[f"recall@{k}"] for k in KS}, out,
                        settings={"passages": result["passages"]})

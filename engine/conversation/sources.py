"""A reply grounded in documents: the passages of a collection (``engine.documents``) that best match
the conversation's last question, and the prompt that gives them to the model as numbered sources
it cites like [1].

A source is a dict (file, page, start, text, score): what the app keeps with the reply (its
"Sources" line and citation markers open these passages, never a path or link from the reply's
text) and what ``fleet serve`` returns beside the reply.
"""

from __future__ import annotations

from pathlib import Path

from engine.documents.collection import Collection

MAX_SOURCES = 4  # passages put in a prompt
MAX_SOURCE_CHARS = 4000  # and at most this much of their text (a small model's context is short)
INSTRUCTION = ("Answer from the numbered sources below when they hold the answer, and cite them by number "
               "like [1]. If they do not hold it, say so.")


def last_question(messages: list[dict]) -> str:
    """The text of the conversation's last user message ("" when it has none)."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content") or ""
            return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    return ""


def find_sources(collection: Collection, question: str) -> list[dict]:
    """The passages of ``collection`` that best match ``question`` (at most ``MAX_SOURCES``, their
    text cut to ``MAX_SOURCE_CHARS`` in all); none for an empty question or no match.  Raises
    ``DocumentError`` when the collection's index cannot be read."""
    if not question.strip():
        return []
    sources, budget = [], MAX_SOURCE_CHARS
    for hit in collection.search(question, k=MAX_SOURCES):
        p = hit.passage
        text = p.text[:budget]
        if not text:
            break
        budget -= len(text)
        sources.append({"file": p.file, "page": p.page, "start": p.start, "text": text, "score": round(hit.score, 3)})
    return sources


def with_sources(prompt: list[dict], sources: list[dict]) -> list[dict]:
    """``prompt`` with the sources as numbered context in its system message (added when it has none)."""
    if not sources:
        return prompt
    context = INSTRUCTION + "\n\n" + "\n\n".join(f"[{n}] {source_where(s)}\n{s['text']}"
                                                  for n, s in enumerate(sources, 1))
    if prompt and prompt[0]["role"] == "system":
        return [{"role": "system", "content": prompt[0]["content"] + "\n\n" + context}, *prompt[1:]]
    return [{"role": "system", "content": context}, *prompt]


def source_where(source: dict) -> str:
    """Where a source comes from, as a reader names it: the file's name, and its page when it has one."""
    name = Path(source["file"]).name
    return name if source.get("page") is None else f"{name}, page {source['page']}"

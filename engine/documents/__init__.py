"""Chat with documents: named collections of the user's files (txt, md, pdf, docx), indexed on this
machine for keyword search (BM25), so a chat can put the passages that answer a question in its prompt.

``readers`` turns a file into pages of text, ``passages`` cuts pages into passages that remember their
file, page and offset, ``collection`` keeps a persisted BM25 index per named collection and brings it up
to date with the files on disk, ``recall`` measures retrieval on the question set shipped in ``eval/``.
Nothing leaves the machine and no model is downloaded: retrieval is BM25 only (no embedding model).
"""

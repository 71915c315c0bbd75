"""Chat history: conversations and their messages in SQLite, in the user data folder.

Used from the GUI thread only.  Every write is a small transaction on a write-ahead log, so the file
is whole whatever moment the app is killed at; a reply in progress is written as it grows (marked
``unfinished`` until it ends), so a killed app loses at most its last second.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import time
from pathlib import Path

from engine.config import paths

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system TEXT NOT NULL DEFAULT '',
    options TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stats TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation, id);
"""


@dataclasses.dataclass
class Message:
    role: str  # "user" | "assistant" | "tool" (an MCP tool's result)
    content: str
    stats: dict = dataclasses.field(default_factory=dict)  # the reply's report (assistant messages)
    id: int | None = None


@dataclasses.dataclass
class Conversation:
    id: int | None
    title: str
    system: str = ""
    messages: list[Message] = dataclasses.field(default_factory=list)
    updated: float = 0.0
    options: dict = dataclasses.field(default_factory=dict)  # the chat's sampling (``fleetgui.chat_options``)

    def prompt(self) -> list[dict]:
        """The messages as the chat template takes them, system prompt first."""
        head = [{"role": "system", "content": self.system}] if self.system.strip() else []
        return head + [_prompt_message(m) for m in self.messages]


def _prompt_message(m: Message) -> dict:
    """A message as the chat template takes it: a reply's tool calls, and a tool result's call id
    (``fleetgui.chat_tools`` keeps both in the message's stats)."""
    if m.role == "assistant" and m.stats.get("tool_calls"):
        return {"role": "assistant", "content": m.content or None, "tool_calls": m.stats["tool_calls"]}
    if m.role == "tool":
        return {"role": "tool", "content": m.content, "tool_call_id": m.stats.get("tool_call_id", "")}
    return {"role": m.role, "content": m.content}


def default_path() -> Path:
    return paths().data / "history.sqlite"


def _make_private(path: Path) -> None:
    """The history (and its WAL journal, which SQLite creates with the database's mode) readable by its
    owner only; a history an older version left readable by others is closed to them."""
    if os.name != "posix":
        return
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if file.exists():
            os.chmod(file, 0o600)


class HistoryStore:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _make_private(self.path)
        self._db = sqlite3.connect(self.path)
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(conversations)")}
        if "options" not in columns:  # a history written before chats had their own sampling
            with self._db:
                self._db.execute("ALTER TABLE conversations ADD COLUMN options TEXT NOT NULL DEFAULT '{}'")

    def close(self) -> None:
        self._db.close()

    def conversations(self, search: str = "") -> list[Conversation]:
        """Every conversation, most recently updated first (without messages); ``search``: only those
        whose title or a message holds that text (any case)."""
        where, args = "", ()
        if search.strip():
            pattern = "%" + search.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            where = ("WHERE title LIKE ? ESCAPE '\\' OR id IN (SELECT conversation FROM messages "
                     "WHERE content LIKE ? ESCAPE '\\')")
            args = (pattern, pattern)
        rows = self._db.execute(f"SELECT id, title, system, updated FROM conversations {where} "
                                "ORDER BY updated DESC, id DESC", args)
        return [Conversation(i, title, system, [], updated) for i, title, system, updated in rows]

    def load(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute("SELECT title, system, updated, options FROM conversations WHERE id = ?",
                               (conversation_id,)).fetchone()
        if row is None:
            return None
        messages = [Message(role, content, json.loads(stats or "{}"), mid) for mid, role, content, stats in
                    self._db.execute("SELECT id, role, content, stats FROM messages WHERE conversation = ? "
                                     "ORDER BY id", (conversation_id,))]
        return Conversation(conversation_id, row[0], row[1], messages, row[2], json.loads(row[3] or "{}"))

    def create(self, title: str, system: str = "", options: dict | None = None) -> int:
        now = time.time()
        with self._db:
            cur = self._db.execute("INSERT INTO conversations (title, system, options, created, updated) "
                                   "VALUES (?, ?, ?, ?, ?)", (title, system, json.dumps(options or {}), now, now))
        return cur.lastrowid

    def update(self, conversation: Conversation) -> None:
        with self._db:
            self._db.execute("UPDATE conversations SET title = ?, system = ?, options = ?, updated = ? WHERE id = ?",
                             (conversation.title, conversation.system, json.dumps(conversation.options), time.time(),
                              conversation.id))

    def rename(self, conversation_id: int, title: str) -> None:
        with self._db:
            self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def append(self, conversation_id: int, message: Message) -> int:
        with self._db:
            cur = self._db.execute("INSERT INTO messages (conversation, role, content, stats) VALUES (?, ?, ?, ?)",
                                   (conversation_id, message.role, message.content, json.dumps(message.stats)))
            self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conversation_id))
        message.id = cur.lastrowid
        return message.id

    def save(self, conversation_id: int, message: Message) -> int:
        """Writes ``message`` (again): appended the first time, its content and stats replaced after."""
        if message.id is None:
            return self.append(conversation_id, message)
        with self._db:
            self._db.execute("UPDATE messages SET content = ?, stats = ? WHERE id = ?",
                             (message.content, json.dumps(message.stats), message.id))
        return message.id

    def remove_message(self, message_id: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def delete(self, conversation_id: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))


def to_markdown(conversation: Conversation) -> str:
    """The conversation as a Markdown document: its title, the system prompt, then each message."""
    parts = [f"# {conversation.title or 'Chat'}"]
    if conversation.system.strip():
        parts.append(f"*System:* {conversation.system.strip()}")
    for m in conversation.messages:
        who = {"user": "You", "tool": f"Tool result ({m.stats.get('name', 'tool')})"}.get(m.role, "Assistant")
        calls = "".join(f"\n\n*Called* `{c['function']['name']}` *with* `{c['function']['arguments']}`"
                        for c in m.stats.get("tool_calls", []))
        parts.append(f"## {who}\n\n{m.content}{calls}")
    return "\n\n".join(parts) + "\n"


def to_json(conversation: Conversation) -> str:
    """The conversation as JSON: title, system prompt, sampling options and messages (role, content)."""
    return json.dumps({"title": conversation.title, "system": conversation.system, "options": conversation.options,
                       "messages": [{"role": m.role, "content": m.content, **({"stats": m.stats} if m.stats else {})}
                                    for m in conversation.messages]}, indent=2, ensure_ascii=False) + "\n"

"""A conversation as a Qt model: ``ConversationModel`` is one chat's messages (a row each) and owns
their persistence through ``fleetgui.history``, so the views that show a chat only read it and listen.

Every change goes through the model: it writes the history (the conversation is created there with
its first message; a reply in progress is written ahead as it grows, marked ``unfinished``) and
tells the views through Qt's row signals (``rowsInserted``, ``rowsRemoved``, ``dataChanged``) and
``title_changed``.
"""

from __future__ import annotations

from PySide6.QtCore import QAbstractListModel, QModelIndex, Qt, Signal

from fleetgui.history import Conversation, HistoryStore, Message

ROLE = Qt.ItemDataRole.UserRole  # a row's role: "user", "assistant" or "tool"
MESSAGE = Qt.ItemDataRole.UserRole + 1  # the row's ``Message``


class ConversationModel(QAbstractListModel):
    """One conversation's messages, kept in ``history``."""

    title_changed = Signal()

    def __init__(self, history: HistoryStore, conversation: Conversation, parent=None):
        super().__init__(parent)
        self.history = history
        self.conversation = conversation

    # --- Qt's model ----------------------------------------------------------------------------------

    def rowCount(self, parent: QModelIndex = QModelIndex()) -> int:  # noqa: B008, N802 (Qt's name)
        return 0 if parent.isValid() else len(self.conversation.messages)

    def data(self, index: QModelIndex, role: int = Qt.ItemDataRole.DisplayRole):
        if not index.isValid() or not 0 <= index.row() < len(self.conversation.messages):
            return None
        message = self.conversation.messages[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return message.content
        if role == ROLE:
            return message.role
        if role == MESSAGE:
            return message
        return None

    # --- reading -------------------------------------------------------------------------------------

    @property
    def messages(self) -> list[Message]:
        return self.conversation.messages

    @property
    def saved(self) -> bool:
        """The conversation is in the history (it is, from its first message on)."""
        return self.conversation.id is not None

    def index_of(self, message: Message) -> int | None:
        return next((i for i, m in enumerate(self.messages) if m is message), None)

    # --- changes -------------------------------------------------------------------------------------

    def set_system(self, system: str) -> None:
        self.conversation.system = system
        if self.saved:
            self.history.update(self.conversation)

    def set_options(self, options: dict) -> None:
        """The chat's options (sampling, tools, documents): the whole dict, kept with the conversation."""
        self.conversation.options = options
        if self.saved:
            self.history.update(self.conversation)

    def retitled(self, title: str) -> None:
        """The title was renamed in the history (by the saved-chats list)."""
        self.conversation.title = title
        self.title_changed.emit()

    def ask(self, text: str) -> Message:
        """The user's message: a new conversation is saved with it (titled after it)."""
        if not self.saved:
            self.conversation.title = " ".join(text.split())[:60]
            self.conversation.id = self.history.create(self.conversation.title, self.conversation.system,
                                                       self.conversation.options)
            self.title_changed.emit()
        else:
            self.history.update(self.conversation)
        return self.append(Message("user", text))

    def append(self, message: Message) -> Message:
        """A message at the end, saved."""
        self.insert(message)
        self.history.append(self.conversation.id, message)
        return message

    def insert(self, message: Message) -> Message:
        """A message at the end, not saved yet (a reply that begins)."""
        row = len(self.messages)
        self.beginInsertRows(QModelIndex(), row, row)
        self.messages.append(message)
        self.endInsertRows()
        return message

    def write(self, message: Message) -> None:
        """Saves ``message`` as it is now (a reply in progress, or one that ended)."""
        self.history.save(self.conversation.id, message)
        row = self.index_of(message)
        if row is not None:
            self.dataChanged.emit(self.index(row), self.index(row))

    def remove(self, row: int) -> Message:
        """Deletes message ``row`` (from the history too)."""
        self.beginRemoveRows(QModelIndex(), row, row)
        message = self.messages.pop(row)
        self.endRemoveRows()
        if message.id is not None:
            self.history.remove_message(message.id)
        return message

    def remove_message(self, message: Message) -> None:
        row = self.index_of(message)
        if row is not None:
            self.remove(row)

    def drop_from(self, row: int) -> None:
        """Deletes message ``row`` and every one after it."""
        if row >= len(self.messages):
            return
        self.beginRemoveRows(QModelIndex(), row, len(self.messages) - 1)
        dropped = self.messages[row:]
        del self.messages[row:]
        self.endRemoveRows()
        for message in dropped:
            if message.id is not None:
                self.history.remove_message(message.id)

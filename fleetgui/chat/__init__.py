"""The Chat view, split by what each part owns:

- ``controller``: ``ChatController``, the engine's chat service for the window (opened off the GUI
  thread, requests queued until it is up, its callbacks relayed to the GUI thread);
- ``model``: ``ConversationModel``, one conversation as a Qt model that owns its persistence
  (``fleetgui.history``);
- ``tab``: ``ChatTab``, the view of one conversation, rendered from its model, and its replies;
- ``view``: ``ChatView``, the model picker, the tabs, the saved chats, the documents and the live plot.
"""

from fleetgui.chat.controller import ChatController
from fleetgui.chat.model import ConversationModel
from fleetgui.chat.tab import ChatTab, format_stats, stats_tooltip
from fleetgui.chat.view import ChatView, model_choices

__all__ = ["ChatController", "ChatTab", "ChatView", "ConversationModel", "format_stats",
           "model_choices", "stats_tooltip"]

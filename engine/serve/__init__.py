"""The OpenAI-compatible HTTP API in front of the chat service (``fleet serve``, the app's API switch)."""

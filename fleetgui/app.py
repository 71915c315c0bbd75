"""Application entry point (``fleetgui``).  The full fleet manager arrives with the GUI issue; until
then the window says what the engine can already do from the command line."""

from __future__ import annotations

import sys


def build_window():
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QLabel, QMainWindow

    window = QMainWindow()
    window.setWindowTitle("fleetshard")
    label = QLabel(
        "fleetshard engine is installed.\n\n"
        "Export shards:   fleet export --model smollm2-135m --stages 2\n"
        "Chat:            fleet generate --model smollm2-135m --stages 2"
    )
    label.setAlignment(Qt.AlignmentFlag.AlignCenter)
    window.setCentralWidget(label)
    window.resize(720, 420)
    return window


def main(argv: list[str] | None = None) -> int:
    from PySide6.QtWidgets import QApplication

    app = QApplication(argv if argv is not None else sys.argv)
    window = build_window()
    window.show()
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())

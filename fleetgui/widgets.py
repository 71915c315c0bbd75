"""Small widgets the views share: plain text for labels and tooltips (bidi controls taken out), the inline
message banner, the
splitter and field-with-button rows several views lay out, a flow layout for rows of buttons that
wrap instead of widening the window, the scroll frame every view sits in, ready-filled spin and
combo boxes for their forms, the model field (``ModelField``) and the wheel guard that keeps a scrolling
wheel from changing them."""

from __future__ import annotations

import html

from PySide6.QtCore import QEvent, QObject, QPoint, QRect, QSize, Qt
from PySide6.QtWidgets import (QAbstractSpinBox, QApplication, QComboBox, QFrame, QHBoxLayout, QLabel, QLayout,
                               QPushButton, QScrollArea, QSizePolicy, QSpinBox, QSplitter, QStyle, QVBoxLayout,
                               QWidget)

from fleetgui.running import folder_tip, model_choices


# Unicode's bidi embedding, override and isolate controls (U+202A-202E, U+2066-2069): text that holds
# them shows its characters in another order than they are in (a reply or a node's name that reads
# backwards, a file name whose extension seems to be another)
BIDI_CONTROLS = dict.fromkeys([*range(0x202A, 0x202F), *range(0x2066, 0x206A)])


def unbidi(text: str) -> str:
    """``text`` without bidi controls (``BIDI_CONTROLS``), so it shows in the order it is written:
    every text from a model, a node, a server or a file that the app shows goes through it."""
    return text.translate(BIDI_CONTROLS)


def plain(widget):
    """``widget`` (a label or a message box) set to show its text as written, bidi controls taken out
    (``unbidi``) of every text given to its ``setText``.  Left to itself, Qt takes text that looks like
    HTML for rich text, and node names, file names, servers' and workers' errors and model output
    reach labels: an ``<img src=file:///dev/zero>`` in one loaded that file until the app died.
    Returns the widget."""
    widget.setTextFormat(Qt.TextFormat.PlainText)
    set_text = widget.setText
    widget.setText = lambda text: set_text(unbidi(text))
    return widget


def plain_tip(text: str) -> str:
    """``text`` as a tooltip that shows it as written, line breaks kept: a tooltip has no text format
    to set, so the text goes escaped into the rich text Qt would otherwise guess at."""
    return f"<p style='white-space:pre-wrap'>{html.escape(unbidi(text), quote=False)}</p>" if text else ""


def plain_line(text: str) -> str:
    """``text`` for a place that has no text format and that one platform shows as written while
    another reads it as markup (the tray icon's tooltip: Windows shows it as it is, Qt's own X11 icon
    takes text that looks like HTML for rich text): a word joiner, which shows as nothing, after each
    ``<`` and ``&``, so no tag or entity is read, and bidi controls out (``unbidi``)."""
    return unbidi(text).replace("<", "<\u2060").replace("&", "&\u2060")


class Banner(QFrame):
    """An inline message above a view (errors from the engine, notices); hidden until shown."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("banner")
        self.text = plain(QLabel())
        self.text.setObjectName("bannerText")
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QPushButton("Dismiss")
        close.setFlat(True)
        close.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.addWidget(self.text, 1)
        layout.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.hide()

    def show_message(self, message: str, level: str = "error") -> None:
        self.setProperty("level", level)
        self.style().unpolish(self)
        self.style().polish(self)
        self.text.setText(message)
        self.show()

    def error(self, message: str) -> None:
        self.show_message(message, "error")

    def info(self, message: str) -> None:
        self.show_message(message, "info")

    @property
    def message(self) -> str:
        return "" if self.isHidden() else self.text.text()


def splitter(orientation: Qt.Orientation, *parts: tuple[QWidget, int]) -> QSplitter:
    """A splitter of (widget, stretch factor) parts."""
    split = QSplitter(orientation)
    for i, (widget, stretch) in enumerate(parts):
        split.addWidget(widget)
        split.setStretchFactor(i, stretch)
    return split


def field_row(field: QWidget, *buttons: QWidget) -> QHBoxLayout:
    """A field that takes the width, with its buttons beside it."""
    row = QHBoxLayout()
    row.addWidget(field, 1)
    for button in buttons:
        row.addWidget(button)
    return row


def explained(field: QWidget | QHBoxLayout, text: str) -> QWidget:
    """A field (or a row of them) with a one-line explanation under it."""
    box = QWidget()
    layout = QVBoxLayout(box)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.setSpacing(1)
    if isinstance(field, QWidget):
        layout.addWidget(field)
    else:
        layout.addLayout(field)
    note = QLabel(text)
    note.setObjectName("hint")
    note.setWordWrap(True)
    layout.addWidget(note)
    return box


def explained_choice(combo: QComboBox, notes: dict[str, str]) -> QWidget:
    """A choice with the explanation of the chosen item under it, following the selection."""
    box = explained(combo, notes.get(combo.currentText(), ""))
    note = box.findChild(QLabel, "hint")
    combo.currentTextChanged.connect(lambda text: note.setText(notes.get(text, "")))
    return box


def spin_box(low: int, high: int, value: int) -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setValue(value)
    return box


class ModelField(QComboBox):
    """Where a form names a model: the models the chat's picker offers (``model_choices``), by name and
    where they run, a file's or folder's path in the tooltip only; a catalog name, a GGUF file or a
    folder may be typed instead.  ``source`` is what the field names."""

    def __init__(self, current: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.setEditable(True)
        self.currentIndexChanged.connect(self._tip)
        self.set_source(current)

    def set_source(self, current: str) -> None:
        """Offers the models anew, ``current`` chosen."""
        self.blockSignals(True)
        self.clear()
        for label, source in model_choices(current):
            self.addItem(label, source)
            self.setItemData(self.count() - 1, plain_tip(folder_tip(source)), Qt.ItemDataRole.ToolTipRole)
        self.setCurrentIndex(self.findData(current))
        self.blockSignals(False)
        self._tip()

    def source(self) -> str:
        """The model the field names: the source of the choice shown, or what was typed."""
        text = self.currentText().strip()
        index = self.findText(text)
        return self.itemData(index) if index >= 0 else text

    def _tip(self) -> None:
        self.setToolTip(plain_tip(folder_tip(self.source())))


def combo_box(items, current: str | None = None, *, editable: bool = False) -> QComboBox:
    box = QComboBox()
    box.setEditable(editable)
    box.addItems(list(items))
    if current is not None:
        box.setCurrentText(current)
    return box


class WheelGuard(QObject):
    """Combo and spin boxes take the mouse wheel only once clicked into (they have the focus);
    otherwise the wheel goes on to what holds them, so scrolling a form scrolls it instead of
    changing whichever choice passes under the pointer.  One for the whole application
    (``guard_wheel``), so every form of every view and dialog has it."""

    def eventFilter(self, watched, event) -> bool:
        if not isinstance(watched, (QComboBox, QAbstractSpinBox)):
            return False
        if event.type() == QEvent.Type.Polish and watched.focusPolicy() == Qt.FocusPolicy.WheelFocus:
            # Qt gives a WheelFocus widget the focus before the wheel event reaches any filter
            watched.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        elif event.type() == QEvent.Type.Wheel and not watched.hasFocus():
            event.ignore()  # Qt hands an ignored wheel event on to the parent: the page scrolls
            return True
        return False


def guard_wheel() -> None:
    """Installs the ``WheelGuard`` on the application (once; nothing without one)."""
    app = QApplication.instance()
    if app is not None and app.findChild(WheelGuard) is None:
        app.installEventFilter(WheelGuard(app))


class FlowLayout(QLayout):
    """Lays its items out left to right and wraps onto a new line where the width ends, so a row of
    buttons never makes its window wider than the longest button.  ``align_right`` pushes each line
    to the right edge (a dialog's or a form's action buttons)."""

    def __init__(self, parent: QWidget | None = None, *, align_right: bool = False):
        super().__init__(parent)
        self._items = []
        self.align_right = align_right
        self.setContentsMargins(0, 0, 0, 0)

    def addItem(self, item) -> None:
        self._items.append(item)

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, index: int):
        return self._items[index] if 0 <= index < len(self._items) else None

    def takeAt(self, index: int):
        return self._items.pop(index) if 0 <= index < len(self._items) else None

    def expandingDirections(self) -> Qt.Orientation:
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:
        return True

    def heightForWidth(self, width: int) -> int:
        return self._arrange(QRect(0, 0, width, 0), apply=False)

    def setGeometry(self, rect: QRect) -> None:
        super().setGeometry(rect)
        self._arrange(rect, apply=True)

    def sizeHint(self) -> QSize:
        """One line of every item."""
        margins = self.contentsMargins()
        width = sum(i.sizeHint().width() for i in self._visible()) + self._gap() * max(0, len(self._visible()) - 1)
        height = max((i.sizeHint().height() for i in self._visible()), default=0)
        return QSize(width + margins.left() + margins.right(), height + margins.top() + margins.bottom())

    def minimumSize(self) -> QSize:
        """The widest single item: everything else can wrap."""
        size = QSize()
        for item in self._visible():
            size = size.expandedTo(item.minimumSize().expandedTo(item.sizeHint()))
        margins = self.contentsMargins()
        return size + QSize(margins.left() + margins.right(), margins.top() + margins.bottom())

    def _visible(self) -> list:
        return [i for i in self._items if not (i.widget() is not None and i.widget().isHidden())]

    def _gap(self) -> int:
        spacing = self.spacing()
        if spacing >= 0:
            return spacing
        parent = self.parentWidget()
        return parent.style().pixelMetric(QStyle.PixelMetric.PM_LayoutHorizontalSpacing) if parent else 6

    def _arrange(self, rect: QRect, apply: bool) -> int:
        margins = self.contentsMargins()
        area = rect.adjusted(margins.left(), margins.top(), -margins.right(), -margins.bottom())
        gap = self._gap()
        lines: list[list] = [[]]
        x = 0
        for item in self._visible():
            w = item.sizeHint().width()
            if lines[-1] and x + w > area.width():
                lines.append([])
                x = 0
            lines[-1].append(item)
            x += w + gap
        y = area.y()
        for line in lines:
            if not line:
                continue
            height = max(i.sizeHint().height() for i in line)
            used = sum(min(i.sizeHint().width(), area.width()) for i in line) + gap * (len(line) - 1)
            x = area.x() + (max(0, area.width() - used) if self.align_right else 0)
            for item in line:
                size = item.sizeHint()
                width = min(size.width(), area.width())
                if apply:
                    item.setGeometry(QRect(QPoint(x, y + (height - size.height()) // 2), QSize(width, size.height())))
                x += width + gap
            y += height + gap
        return y - gap - area.y() + margins.top() + margins.bottom() if y > area.y() else 0


def flow_bar(*widgets: QWidget, align_right: bool = False) -> tuple[QWidget, FlowLayout]:
    """A widget holding ``widgets`` in a ``FlowLayout``; returns it and the layout (more can be added)."""
    bar = QWidget()
    layout = FlowLayout(bar, align_right=align_right)
    for widget in widgets:
        layout.addWidget(widget)
    policy = QSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
    policy.setHeightForWidth(True)
    bar.setSizePolicy(policy)
    return bar, layout


class ScrollColumn(QScrollArea):
    """A column of controls that scrolls up and down on a short screen, never across: as wide as its
    contents need (a plain scroll area's hint is small, so a splitter would cut them at the side)."""

    def __init__(self, contents: QWidget, parent: QWidget | None = None):
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setWidget(contents)

    def _widened(self, hint: QSize, contents: QSize) -> QSize:
        return QSize(contents.width() + self.verticalScrollBar().sizeHint().width(), hint.height())

    def minimumSizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        return self._widened(super().minimumSizeHint(), self.widget().minimumSizeHint())

    def sizeHint(self) -> QSize:  # noqa: N802 (Qt's name)
        return self._widened(super().sizeHint(), self.widget().sizeHint())


class ViewFrame(QScrollArea):
    """What holds a view in the main window: the view takes the whole area, and were it ever to need
    more than the window has (a huge system font), it scrolls instead of pushing the window past the
    screen's edge."""

    def __init__(self, view: QWidget, parent: QWidget | None = None):
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.NoFrame)
        # sized here, not by widgetResizable: that gives a view with wrapping rows its preferred
        # height (scrolling whenever the window is shorter), where the view fits down to its minimum
        self.setWidgetResizable(False)
        self.setWidget(view)
        view.installEventFilter(self)

    def view(self) -> QWidget:
        return self.widget()

    def _fit(self) -> None:
        view, area = self.widget(), self.viewport().size()
        minimum = view.minimumSizeHint().expandedTo(view.minimumSize())
        width = max(area.width(), minimum.width())
        layout = view.layout()
        low = layout.totalMinimumHeightForWidth(width) if layout is not None and layout.hasHeightForWidth() \
            else minimum.height()
        view.resize(width, max(area.height(), low, minimum.height()))

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._fit()

    def eventFilter(self, watched, event) -> bool:
        result = super().eventFilter(watched, event)
        if watched is self.widget() and event.type() == event.Type.LayoutRequest:
            self._fit()  # the view's minimum changed (a banner shown, a row wrapped)
        return result

"""fleetgui: the PySide6 desktop app (views and Qt glue only; inference lives in ``engine``)."""

from fleetgui import qtfix

qtfix.install()

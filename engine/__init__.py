"""fleetshard engine: shard export, the stage runtime and the generation loop (no Qt here)."""


def _version() -> str:
    """fleetshard's release: the installed package's metadata, else (a checkout never installed, a bundle
    that carries ``pyproject.toml``) the ``pyproject.toml`` beside the package, else ``0+unknown``.  The
    pyproject's ``version`` is the one place the number is written."""
    # imported here so that the package's namespace holds its subpackages and __version__ alone
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path  # here for the same reason

    try:
        return version("fleetshard")
    except PackageNotFoundError:
        pass
    try:
        import tomllib  # only a checkout or a bundle without the package's metadata reads the pyproject

        with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return "0+unknown"


__version__ = _version()

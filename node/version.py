"""The installed shoal version (what announcements, status files and `--version` say)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def shoal_version() -> str:
    try:
        return version("shoal")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"

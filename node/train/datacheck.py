"""What is checked about a run's data before anything trains: the packages a source needs, the Hugging Face Hub
(reachable, the dataset, its configuration, split and text column), local files. Each failure is one line with the
fix (`DataUnavailable`), raised before a node asks for a place or a trainer starts."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'shoal[hf]'"
PROBE_TIMEOUT_S = 5.0  # one TCP connect to the Hub before asking the library (whose retries take ~30 s offline)
LOCAL_FIX = "or train on local files: --data PATH (.txt, .jsonl, .parquet or a folder of them)"


class DataUnavailable(RuntimeError):
    """The run's data cannot be read on this machine; the message says why and what to do."""


def require_datasets():
    try:
        import datasets
    except ImportError:
        raise DataUnavailable(f"an hf: data source needs the `datasets` package: {INSTALL_HINT}") from None
    return datasets


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def probe_hub(timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the Hub cannot be reached (None: a TCP connection opened, or a proxy is set, which the library uses)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    u = urlparse(hub_endpoint())
    host, port = u.hostname or "", u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return f"{host}:{port}: {e.strerror or e}"


def check_hf_dataset(name: str, config: str = "", split: str = "train", text_field: str = "text") -> str:
    """Raise DataUnavailable unless dataset `name` can be streamed from here; returns a short description."""
    datasets = require_datasets()
    what = f"hf:{name}" + (f" ({config})" if config else "")
    if not _offline():
        why = probe_hub()
        if why is not None:
            raise DataUnavailable(f"data source {what}: cannot reach the Hugging Face Hub at {hub_endpoint()} "
                                  f"({why}); check the network, or use a copy cached here with HF_HUB_OFFLINE=1, "
                                  f"{LOCAL_FIX}")
    try:
        builder = datasets.load_dataset_builder(name, config or None)
    except Exception as e:  # noqa: BLE001 - the library's errors: not found, offline without a cache, gated, ...
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if _offline():
            raise DataUnavailable(f"data source {what}: offline (HF_HUB_OFFLINE) and not in the local cache "
                                  f"({reason}); run once online, {LOCAL_FIX}") from None
        if "DatasetNotFound" in type(e).__name__ or isinstance(e, FileNotFoundError):
            raise DataUnavailable(f"data source {what}: no such dataset on the Hub ({reason}); check its name "
                                  f"(owner/name)") from None
        raise DataUnavailable(f"data source {what}: the Hub did not give the dataset ({reason}); {LOCAL_FIX}") from None
    info = builder.info
    if info.splits and split not in info.splits:
        raise DataUnavailable(f"data source {what}: no split {split!r} (splits: {', '.join(info.splits)}); "
                              f"--data-split NAME")
    columns = list(info.features) if info.features is not None else None
    if columns is None:  # the metadata does not say: read the first row of the stream
        try:
            row = next(iter(datasets.load_dataset(name, config or None, split=split, streaming=True)), None)
        except Exception as e:  # noqa: BLE001 - a bad split is a ValueError, the rest is the library's
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            if "split" in first.lower():
                raise DataUnavailable(f"data source {what}: no split {split!r} ({first}); --data-split NAME") from None
            raise DataUnavailable(f"data source {what}: cannot read its first row ({type(e).__name__}: {first}); "
                                  f"{LOCAL_FIX}") from None
        if row is None:
            raise DataUnavailable(f"data source {what}: split {split!r} holds no rows")
        columns = list(row)
    if text_field not in columns:
        raise DataUnavailable(f"data source {what}: no column {text_field!r} (columns: {', '.join(columns)}); "
                              f"--text-field NAME")
    return what


def check_source(source: str, *, hf_config: str = "", hf_split: str = "train", text_field: str = "text") -> None:
    """Raise DataUnavailable (or ValueError for a bad name) unless `source` can be read here."""
    if source == "stdlib":
        return
    if source.startswith("hf:"):
        check_hf_dataset(source[3:], hf_config, hf_split, text_field)
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise DataUnavailable(f"data source {source!r}: no such file or folder (use 'stdlib', a .txt/.jsonl/.parquet "
                              f"path or a folder of them, or hf:NAME)")
    parquet = path.suffix == ".parquet" or (path.is_dir() and any(path.rglob("*.parquet")))
    if parquet:
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise DataUnavailable(f"data source {source!r}: reading parquet needs `pyarrow`: {INSTALL_HINT}") from None

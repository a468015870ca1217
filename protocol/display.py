"""How shoal shows values to people, the same in every table, status line and the dashboard: peer ids abbreviated
one way, sizes and rates in decimal (SI) units."""

from __future__ import annotations

LIBP2P_ED25519_PREFIX = "12D3KooW"  # every Ed25519 peer id starts with it: shown, it tells peers apart by nothing
SHORT_ID_CHARS = 8


def short_id(peer_id: str, n: int = SHORT_ID_CHARS) -> str:
    """A peer id short enough for a table: the common '12D3KooW' prefix dropped, the next `n` characters."""
    body = peer_id[len(LIBP2P_ED25519_PREFIX):] if peer_id.startswith(LIBP2P_ED25519_PREFIX) \
        and len(peer_id) > len(LIBP2P_ED25519_PREFIX) else peer_id
    return body[:n]


def si(value: float, unit: str = "", digits: int = 3) -> str:
    """1234567 -> '1.23M' (+unit); keeps `digits` significant digits."""
    v = float(value)
    prefix = ""
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(v) < 999.5 or prefix == "P":
            break
        v /= 1000.0
    if v == int(v) and abs(v) < 1000:
        text = f"{int(v)}"
    else:
        whole = len(str(int(abs(v))))
        text = f"{v:.{max(digits - whole, 0)}f}"
    return f"{text}{prefix}{unit}"


def nbytes(n: float, digits: int = 3) -> str:
    """A size in decimal units, as rates are shown: 17116080 -> '17.1 MB', 512 -> '512 B'."""
    text = si(n, digits=digits)
    return f"{text[:-1]} {text[-1]}B" if text[-1].isalpha() else f"{text} B"


def rate(bytes_per_s: float, digits: int = 3) -> str:
    return f"{nbytes(bytes_per_s, digits)}/s"

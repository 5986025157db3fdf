"""Personal data in text: e-mail addresses, phone numbers, IP addresses, Chinese
resident identity numbers. Found by pattern, then validated (an IP's octets, an ID
number's birth date and ISO 7064 check character), so ordinary numbers are left alone.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from collections import Counter
from collections.abc import Callable, Iterable

from lmforge.data.rule_names import PII_KINDS

KINDS = PII_KINDS  # declared with the rule names: config validates without this module
PLACEHOLDERS = {"email": "<EMAIL>", "phone": "<PHONE>", "ip": "<IP>", "cn_id": "<ID_NUMBER>"}

_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*"
                    r"\.[A-Za-z]{2,24}\b")
_PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"\+\d{1,3}[ .-]?\(?\d{1,4}\)?(?:[ .-]?\d{2,4}){2,4}"  # +44 20 7946 0958, +86 138 0013 8000
    r"|\(\d{3}\)[ ]?\d{3}[ .-]\d{4}"  # (555) 123-4567
    r"|\d{3}[.-]\d{3}[.-]\d{4}"  # 555-123-4567
    r"|1[3-9]\d[ -]?\d{4}[ -]?\d{4}"  # Chinese mobile 138 0013 8000
    r"|0\d{2,3}-\d{7,8}"  # Chinese landline 010-12345678
    r")(?![\w])"
)
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.]|\.\d)")
_CN_ID = re.compile(r"(?<![\dA-Za-z])\d{17}[\dXx](?![\dA-Za-z])")
_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_ID_CHECK = "10X98765432"


def valid_cn_id(number: str) -> bool:
    """An 18-character resident ID with a real birth date and a correct check character."""
    if len(number) != 18 or not number[:17].isdigit():
        return False
    try:
        born = datetime.date(int(number[6:10]), int(number[10:12]), int(number[12:14]))
    except ValueError:
        return False
    if not 1900 <= born.year <= 2100:
        return False
    total = sum(int(d) * w for d, w in zip(number[:17], _ID_WEIGHTS, strict=True))
    return _ID_CHECK[total % 11] == number[17].upper()


def valid_ipv4(address: str, public_only: bool = True) -> bool:
    """A dotted quad with octets <= 255; with ``public_only``, not private/loopback/reserved."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        return False
    return ip.is_global if public_only else True


def _phone_ok(match: str) -> bool:
    digits = sum(c.isdigit() for c in match)
    return 7 <= digits <= 15  # E.164 allows at most 15 digits


_FINDERS: dict[str, tuple[re.Pattern[str], Callable[[str], bool], str]] = {
    # kind: (pattern, validator, a substring every match contains, for a cheap skip)
    "email": (_EMAIL, lambda s: True, "@"),
    "phone": (_PHONE, _phone_ok, ""),
    "ip": (_IPV4, valid_ipv4, "."),
    "cn_id": (_CN_ID, valid_cn_id, ""),
}


def find(text: str, kinds: Iterable[str] = KINDS) -> list[tuple[int, int, str]]:
    """Validated (start, end, kind) spans, in text order, without overlaps."""
    spans = []
    for kind in kinds:
        pattern, valid, cue = _FINDERS[kind]
        if cue and cue not in text:
            continue
        spans.extend((m.start(), m.end(), kind) for m in pattern.finditer(text) if valid(m.group()))
    spans.sort()
    out: list[tuple[int, int, str]] = []
    for s in spans:
        if not out or s[0] >= out[-1][1]:
            out.append(s)
    return out


def redact(text: str, kinds: Iterable[str] = KINDS) -> tuple[str, Counter]:
    """``text`` with every found span replaced by its placeholder, and counts per kind."""
    spans = find(text, kinds)
    if not spans:
        return text, Counter()
    pieces, last = [], 0
    for start, end, kind in spans:
        pieces += [text[last:start], PLACEHOLDERS[kind]]
        last = end
    pieces.append(text[last:])
    return "".join(pieces), Counter(kind for _, _, kind in spans)

"""Request bodies: bytes -> a JSON object -> a validated pydantic model, every problem a 400 naming its field.

Pure functions, except `log_ignored`, which writes one warning per unknown field name (not per request).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .errors import APIError, invalid_request

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

# A JSON escape of a UTF-16 surrogate (\uD800-\uDFFF). json.loads joins valid pairs into one character,
# so after parsing, any surrogate left is a lone half that no tokenizer or encoder can take.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any, where: str = "") -> tuple[str, str] | None:
    """(path, the surrogate as an escape) of the first string holding a lone surrogate, else None."""
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        return (where or "body", f"\\u{ord(m.group()):04x}") if m else None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _lone_surrogate(k, where) or _lone_surrogate(v, f"{where}.{k}" if where else str(k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{where}[{i}]")
            if found:
                return found
    return None


def read_json(body: bytes) -> dict[str, Any]:
    """Decode a request body; malformed or non-object JSON is a 400 naming the problem."""
    if not body:
        raise invalid_request("The request body is empty; expected a JSON object.")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid_request(f"The request body is not valid UTF-8 (byte {e.start}).") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid_request(
            f"The request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}."
        ) from None
    except (ValueError, RecursionError) as e:
        # int() digit limit (a 5000-digit number) or absurd nesting: still the client's fault.
        raise invalid_request(f"The request body could not be parsed: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise invalid_request(f"The request body must be a JSON object, got {type(data).__name__}.")
    if _SURROGATE_ESCAPE.search(text):
        found = _lone_surrogate(data)
        if found:
            where, esc = found
            raise invalid_request(
                f"'{where}' contains a lone UTF-16 surrogate ({esc}), which is not valid Unicode; "
                "send both halves of a surrogate pair or the character itself.",
                param=where,
            )
    return data


def _loc_to_param(loc: tuple[Any, ...]) -> tuple[str, str | None]:
    """pydantic loc -> ("messages[0].content", union branch tag or None)."""
    out = ""
    tag = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in {"str", "int", "float", "bool", "none"} or part[:1].isupper():
            tag = tag or part  # a union branch name, not a field
        else:
            out += f".{part}" if out else part
    return out, tag


def validation_error(e: ValidationError) -> APIError:
    """Turn pydantic's first complaint into one clear 400 (OpenAI reports one problem at a time)."""
    errors = e.errors(include_url=False)
    first = errors[0]
    param, _ = _loc_to_param(first["loc"])
    if first["type"] == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param=param)
    # A union field fails once per branch; say which forms are accepted instead of the first branch's gripe.
    same = [err for err in errors if _loc_to_param(err["loc"])[0] == param]
    tags = [t for t in (_loc_to_param(err["loc"])[1] for err in same) if t]
    if len(set(tags)) > 1:
        return invalid_request(
            f"Invalid type for '{param}': expected one of {', '.join(dict.fromkeys(tags))}.", param=param
        )
    value = first.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return invalid_request(f"Invalid value for '{param}': {first['msg']} (got {shown}).", param=param)


def validate(cls: type[M], data: dict[str, Any]) -> M:
    try:
        model = cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    log_ignored(model)
    return model


# ------------------------------------------------------------------------------------ ignored fields

_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()
# a hostile client could send endless distinct names: past this many, new ones are not logged
_MAX_WARNED = 512


def ignored_fields(model: BaseModel, where: str = "") -> list[str]:
    """Names of the unknown keys in ``model`` and the models nested in it (messages[0].x ...)."""
    out = [f"{where}{k}" for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                sub = f"{where}{name}[{i}]." if isinstance(value, list) else f"{where}{name}."
                out.extend(ignored_fields(item, sub))
    return out


def log_ignored(model: BaseModel) -> None:
    """Warn once per field name that a request carried a field this server ignores (as vLLM logs them)."""
    names = ignored_fields(model)
    if not names:
        return
    # one warning per name, whatever the message index: messages[3].x is messages[*].x
    keys = {re.sub(r"\[\d+\]", "[*]", n) for n in names}
    with _WARNED_LOCK:
        new = sorted(k for k in keys if k not in _WARNED)
        if not new or len(_WARNED) >= _MAX_WARNED:
            return
        _WARNED.update(new)
    log.warning("The following fields were present in the request but ignored: %s", ", ".join(new))

"""Settings that do not load, said in one line: which setting, what is wrong, what was meant.

A typo in a settings file or a KVPLANE_* variable must not cost a newcomer a 17-line traceback:
each problem is named by its dotted path (and the variable that sets it), an unknown name with the
closest known one. A section's own check is named by the section alone: its values (which may be
secrets) are never repeated.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError


class SettingsError(ValueError):
    """Settings that cannot be loaded; the message is one line."""


def _model_at(model: type[BaseModel], path: Sequence[Any]) -> type[BaseModel] | None:
    """The settings model that holds the field at `path`, if the path walks through models."""
    for part in path:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _variable(path: Sequence[Any]) -> str:
    return "KVPLANE_" + "__".join(str(p).upper() for p in path)


def describe(exc: ValidationError, model: type[BaseModel]) -> str:
    """Every problem of `exc`, on one line."""
    problems: list[str] = []
    for err in exc.errors():
        path = [p for p in err["loc"] if not isinstance(p, int)]
        name = ".".join(str(p) for p in err["loc"]) or "settings"
        if err["type"] == "extra_forbidden" and path:
            holder = _model_at(model, path[:-1])
            known = list(holder.model_fields) if holder is not None else []
            close = difflib.get_close_matches(str(path[-1]), known, n=1, cutoff=0.6)
            hint = f" (did you mean {'.'.join([*map(str, path[:-1]), close[0]])}?)" if close else ""
            problems.append(f"unknown setting {name}{hint}")
        elif err["type"] == "value_error" and isinstance(err.get("input"), dict):
            # A section's own check: its input is the whole section, secrets and all (an etcd
            # password, a mesh secret), and the message already names what is wrong.
            problems.append(f"{name}: {err['msg'].removeprefix('Value error, ')}")
        else:
            value = repr(err.get("input"))
            shown = value if len(value) <= 40 else value[:37] + "..."
            where = f" ({_variable(path)} or the file's {name})" if path else ""
            problems.append(f"{name}: {err['msg']}, got {shown}{where}")
    return "; ".join(problems)

"""Jobs handed to another process (the collection, ``torchrun``'s ranks) as JSON files.

A job is a dataclass everywhere but in its file: ``write_job`` writes its fields (nested settings
dataclasses as objects), ``read_job`` builds it back, checking every field against the
dataclass's annotations, and refuses a file with an unknown, missing or mistyped field by name.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path


class JobError(ValueError):
    """A job file that does not describe the job it is read as; the message names the field."""


def job_to_json(job) -> dict:
    """The job's fields, nested dataclasses as objects, tuples as lists (plain JSON)."""
    return json.loads(json.dumps(dataclasses.asdict(job)))


def write_job(job, path: Path) -> Path:
    path.write_text(json.dumps(job_to_json(job), indent=1))
    return path


def read_job(cls, path: str | Path):
    """The job of type ``cls`` that ``path`` holds."""
    return job_from_json(cls, json.loads(Path(path).read_text()), str(path))


def job_from_json(cls, data, where: str = "job", prefix: str = ""):
    """``cls`` from its JSON object; ``JobError`` names the first field that does not fit
    (``prefix``: the path of a nested job's field, e.g. ``settings.``)."""
    if not isinstance(data, dict):
        raise JobError(f"{where}: {prefix.rstrip('.') or 'the job'} must be a JSON object with "
                       f"the fields of {cls.__name__}, not {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise JobError(f"{where}: unknown field {prefix + unknown[0]!r} (a {cls.__name__} has "
                       f"{', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, field in fields.items():
        if name in data:
            values[name] = _value(hints[name], data[name], where, prefix + name)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise JobError(f"{where}: field {prefix + name!r} is missing")
    return cls(**values)


def _value(hint, value, where: str, field: str):
    """``value`` as ``hint`` says (a nested dataclass built, a list made a tuple), or
    ``JobError`` naming ``field``."""
    if dataclasses.is_dataclass(hint):
        return job_from_json(hint, value, where, field + ".")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            try:
                return _value(option, value, where, field)
            except JobError:
                continue
    elif origin in (tuple, list):
        if isinstance(value, list):
            items = [_value(args[0] if args else typing.Any, v, where, field) for v in value]
            return tuple(items) if origin is tuple else items
    elif hint is typing.Any or (hint is type(None) and value is None):
        return value
    elif hint in (int, float):  # a JSON true is no number, though Python's bool is an int
        if isinstance(value, (int, float) if hint is float else int) \
                and not isinstance(value, bool):
            return value
    elif isinstance(origin or hint, type) and isinstance(value, origin or hint):
        return value
    raise JobError(f"{where}: field {field!r}: {value!r} is not {_name(hint)}")


def _name(hint) -> str:
    return "null" if hint is type(None) else getattr(hint, "__name__", None) or str(hint)

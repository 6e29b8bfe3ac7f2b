"""Command-line flags generated from config dataclasses.

A field becomes a flag when its metadata has a ``help``; its default, type and
choices are the field's own, so each is written once, in the dataclass:

    max_num_seqs: int = field(default=64, metadata={"help": "sequences running at once"})

Other metadata keys: ``flag`` (the option string when it is not ``--`` plus the
name with dashes), ``group`` (a key of the argument groups the caller passes;
the caller's default group otherwise), ``choices`` (when the type is not a
``Literal``), ``metavar``, ``nargs`` (``"+"``: one flag, several values) and
``action`` (``"append"``: a repeatable flag). A ``bool`` is a switch: a field
that defaults to False is set by its flag, one that defaults to True is cleared
by it (so it names its ``flag``, e.g. ``--disable-ced``). The parsed value lands
under the field's name and ``from_args`` builds the dataclass from it; a field
without ``help`` has no flag and keeps its default unless the caller gives it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

# What a flag may carry besides its help; anything else in a field's metadata is an error.
_KEYS = frozenset({"help", "flag", "group", "choices", "metavar", "nargs", "action"})


class ArgumentContainer(Protocol):
    """A parser or an argument group: what flags are added to."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """One field's flag: where it goes and what ``add_argument`` is told."""

    field: str
    option: str
    group: str | None
    kwargs: dict[str, Any]


def flags_of(
    cls: type,
    *,
    group: str | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> list[Flag]:
    """The flags of ``cls``'s fields, in field order.

    ``group``: the group of fields that name none.
    ``defaults``: flag defaults that differ from the field's (e.g. read from
    the environment); the dataclass default stays what it is.
    """
    flags = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        unknown = set(meta) - _KEYS
        if unknown:
            raise TypeError(f"{cls.__name__}.{f.name}: unknown flag metadata {sorted(unknown)}")
        default = (defaults or {}).get(f.name, _field_default(f))
        option = meta.get("flag", "--" + f.name.replace("_", "-"))
        kwargs = _argument_kwargs(f"{cls.__name__}.{f.name}", _field_type(cls, f), default, meta)
        kwargs.update(dest=f.name, help=meta["help"])
        switch = kwargs.get("action") in ("store_true", "store_false")
        if not switch and "metavar" not in kwargs and "choices" not in kwargs:
            # argparse's own name for it, from the option rather than the field.
            kwargs["metavar"] = option.lstrip("-").replace("-", "_").upper()
        flags.append(Flag(f.name, option, meta.get("group", group), kwargs))
    return flags


def add_flags(groups: Mapping[str | None, ArgumentContainer], flags: list[Flag]) -> None:
    """Add ``flags`` to the parser or group each names (``None``: the parser itself)."""
    for flag in flags:
        if flag.group not in groups:
            raise KeyError(f"flag {flag.option}: no argument group {flag.group!r}")
        groups[flag.group].add_argument(flag.option, **flag.kwargs)


def from_args(
    cls: type[T],
    args: argparse.Namespace,
    **given: Any,
) -> T:
    """``cls`` built from the parsed flags of its fields, and ``given`` for the rest.

    A field the caller gives (a value several flags compose, or one the command
    decides) is taken from ``given`` even when it has a flag of its own; a field
    with neither keeps its default.
    """
    kwargs: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for flag in flags_of(cls):
        if flag.field in given:
            continue
        value = getattr(args, flag.field)
        if isinstance(value, list):  # nargs / append: the field holds a tuple
            value = tuple(value)
        elif value is None and flag.kwargs.get("action") == "append":
            value = _field_default(fields[flag.field])
        kwargs[flag.field] = value
    return cls(**kwargs, **given)


def _field_type(cls: type, f: dataclasses.Field[Any]) -> Any:
    """The field's annotation, evaluated in its class's module (``typing.get_type_hints``
    would evaluate every field's, so a module could not keep the types of its fields
    without flags behind TYPE_CHECKING, out of the way of a fast ``--help``)."""
    if not isinstance(f.type, str):
        return f.type
    return eval(f.type, vars(sys.modules[cls.__module__]))


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return ()  # a required field can only be a repeatable flag's: none given


def _argument_kwargs(name: str, hint: Any, default: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    """``type``, ``choices``, ``action``, ``nargs`` and ``default`` from the field's type."""
    kwargs: dict[str, Any] = {k: meta[k] for k in ("choices", "metavar", "nargs") if k in meta}
    hint = _without_none(hint)
    if hint is bool:
        if default and "flag" not in meta:
            raise TypeError(
                f"{name}: a switch that defaults to True needs the 'flag' that clears it"
            )
        return {**kwargs, "action": "store_false" if default else "store_true", "default": default}
    if typing.get_origin(hint) is tuple:
        hint = typing.get_args(hint)[0]
        if "nargs" not in meta and meta.get("action") != "append":
            raise TypeError(f"{name}: a tuple field needs nargs or action='append'")
    if typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        kwargs.setdefault("choices", values)
        hint = type(values[0])
    if "action" in meta:
        kwargs["action"] = meta["action"]
        # argparse appends to the default in place: start from None, not the field's tuple.
        default = None
    if hint is not str:
        kwargs["type"] = hint
    return {**kwargs, "default": default}


def _without_none(hint: Any) -> Any:
    """``X`` of ``X | None``; the first member of a wider union (``str | Path``: ``str``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        return members[0]
    return hint

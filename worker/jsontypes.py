"""The numbers and booleans of the bodies that nodes and workers send, as JSON Schema types them.

pydantic's lax mode takes `true`/`false` for a number (as 1/0), `"3"` for 3 and `1` for `true`,
which JSON Schema's `integer`, `number` and `boolean` do not: their fields are strict
(`StrictInt`, `StrictFloat`, `StrictBool`), checked in pydantic's core, and a 422 names the
field. Strict integers refuse `3.0`, which JSON Schema's `integer` takes: a `JsonBody` makes an
integral float of its integer fields an int first, in one call per body (not one per field: the
frequent bodies, heartbeats and log shipments, pay little), and keeps the fields' rules
(`ge`, `le`) in the OpenAPI as `minimum` and `maximum` (a validator on the type itself would not).
"""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

from pydantic import BaseModel, StrictBool, StrictFloat, StrictInt, model_validator

JsonInt = StrictInt
JsonFloat = StrictFloat  # an int or a float; never a boolean or a string
JsonBool = StrictBool


def _is_integer(annotation: Any) -> bool:
    """int (StrictInt among them), or a union with it (int | None)."""
    if get_origin(annotation) is Annotated:
        return _is_integer(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        return any(_is_integer(a) for a in get_args(annotation))
    return annotation is int


def integral(value: Any) -> Any:
    """`value` as an int if it is a float with no fraction (JSON Schema's integer)."""
    return int(value) if type(value) is float and value.is_integer() else value


class JsonBody(BaseModel):
    """A request body whose integer fields take an integral float (module docstring)."""

    _integer_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._integer_fields = tuple(n for n, f in cls.model_fields.items() if _is_integer(f.annotation))

    @model_validator(mode="before")
    @classmethod
    def _integral_integers(cls, data: Any) -> Any:
        if type(data) is dict:
            for name in cls._integer_fields:
                if type(data.get(name)) is float:
                    return {**data, **{n: integral(data[n]) for n in cls._integer_fields if n in data}}
        return data


__all__ = ["JsonBody", "JsonBool", "JsonFloat", "JsonInt", "integral"]

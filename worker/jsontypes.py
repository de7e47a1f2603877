"""The numbers and booleans of the bodies that nodes and workers send, as JSON Schema types them.

pydantic's lax mode takes `true`/`false` for a number (as 1/0), `"3"` for 3 and `1` for `true`,
which JSON Schema's `integer`, `number` and `boolean` do not; its strict mode refuses `3.0` for
an integer, which JSON Schema takes. These follow JSON Schema: a 422 names the field. The checks
run in pydantic's core, but for one small call per integer (an integral float made an int).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, StrictBool, StrictFloat, StrictInt


def _integral(value: object) -> object:
    if type(value) is float and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[StrictInt, BeforeValidator(_integral)]
JsonFloat = StrictFloat  # int or float; never a boolean or a string
JsonBool = StrictBool

__all__ = ["JsonBool", "JsonFloat", "JsonInt"]

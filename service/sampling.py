"""The one conversion from API request fields to SamplingParams, shared by REST and gRPC."""

from __future__ import annotations

import re

import msgspec

from inference import InvalidParameterError, SamplingParams

_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")


def build_sampling_params(**fields) -> SamplingParams:
    """Fields left as None take SamplingParams' defaults. Type and range errors come back as
    InvalidParameterError naming the field."""
    values = {k: v for k, v in fields.items() if v is not None}
    try:
        return msgspec.convert(values, SamplingParams)
    except msgspec.ValidationError as exc:
        if isinstance(exc.__cause__, InvalidParameterError):
            raise exc.__cause__ from None
        m = _PATH.search(str(exc))
        raise InvalidParameterError(
            m.group(1) if m else "params", str(exc).split(" - at ")[0]
        ) from None

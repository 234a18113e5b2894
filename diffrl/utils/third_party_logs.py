"""Third-party log lines that say nothing to a diffrl user, dropped at their logger (numerics untouched)."""

from __future__ import annotations

import logging
import re

# diffusers' `ModelMixin.to(dtype)` warns that some modules "should be kept in float32" on every cast, also when
# the model keeps none (its check reads `self._keep_in_fp32_modules or []` and then tests `is not None`): the
# list printed is then `[]` and nothing is cast differently. A non-empty list still warns.
_EMPTY_FP32_CAST = re.compile(r"There are modules in \w+ that should be kept in float32: \[\]\. Casting directly")
DIFFUSERS_MODELING_LOGGER = "diffusers.models.modeling_utils"


class _DropEmptyFp32CastWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _EMPTY_FP32_CAST.match(record.getMessage()) is None


def quiet_empty_fp32_cast_warning() -> None:
    """Drop diffusers' keep-in-float32 warning on a cast of a model that keeps no module in float32 (idempotent)."""
    logger = logging.getLogger(DIFFUSERS_MODELING_LOGGER)
    if not any(isinstance(f, _DropEmptyFp32CastWarning) for f in logger.filters):
        logger.addFilter(_DropEmptyFp32CastWarning())

"""Cache quantisation formats (registry: kvlab.registry.QUANT_FORMATS)."""

from kvlab.cache.quant import auto, cast, fp8, int8, kivi  # noqa: F401  (register)
from kvlab.cache.quant.base import QuantFormat

__all__ = ["QuantFormat"]

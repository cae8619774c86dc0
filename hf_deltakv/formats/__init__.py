"""Block formats as data (the table every kernel reads), bit packing, reference quantize/dequantize, byte counting."""

from .blocks import (
    FP16_MAX,
    QuantizedTensor,
    dequantize,
    nbytes_of,
    quantize,
    quantize_f16,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q8_0,
)
from .packing import pack_4bit, unpack_4bit
from .table import FORMATS, BlockFormat, Kind, get_format

__all__ = [
    "FORMATS",
    "FP16_MAX",
    "BlockFormat",
    "Kind",
    "QuantizedTensor",
    "dequantize",
    "get_format",
    "nbytes_of",
    "pack_4bit",
    "quantize",
    "quantize_f16",
    "quantize_q4_0",
    "quantize_q4_1",
    "quantize_q8_0",
    "unpack_4bit",
]

"""llama.cpp block formats: data declarations, bit packing, quantize/dequantize."""

from .blocks import (
    QuantizedTensor,
    dequantize,
    quantize,
    quantize_f16,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q8_0,
)
from .formats import FORMATS, BlockFormat, get_format
from .packing import pack_4bit, unpack_4bit

__all__ = [
    "FORMATS",
    "BlockFormat",
    "QuantizedTensor",
    "dequantize",
    "get_format",
    "pack_4bit",
    "quantize",
    "quantize_f16",
    "quantize_q4_0",
    "quantize_q4_1",
    "quantize_q8_0",
    "unpack_4bit",
]

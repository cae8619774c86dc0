"""Block formats as data (the table every kernel reads), bit packing, reference quantize/dequantize, byte counting."""

from .blocks import (
    FP16_MAX,
    QuantizedTensor,
    dequantize,
    nbytes_of,
    owned,
    quantize,
    quantize_f16,
    quantize_q3_0,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q8_0,
    saturate_fp16,
)
from .packing import pack_3bit, pack_4bit, unpack_3bit, unpack_4bit
from .table import FORMATS, SEARCHABLE_KINDS, BlockFormat, Kind, check_search_scale, get_format

__all__ = [
    "FORMATS",
    "FP16_MAX",
    "SEARCHABLE_KINDS",
    "BlockFormat",
    "Kind",
    "QuantizedTensor",
    "check_search_scale",
    "dequantize",
    "get_format",
    "nbytes_of",
    "owned",
    "pack_3bit",
    "pack_4bit",
    "quantize",
    "quantize_f16",
    "quantize_q3_0",
    "quantize_q4_0",
    "quantize_q4_1",
    "quantize_q8_0",
    "saturate_fp16",
    "unpack_3bit",
    "unpack_4bit",
]

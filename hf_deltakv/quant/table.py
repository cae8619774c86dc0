"""Block formats declared as data: what a format costs is checked, not assumed.

This table is the one definition of every format, for Python and for the kernels: each format's `kind` is the
integer the C++ and Triton kernels switch on (handed to them from `KINDS`, never written twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Kind(IntEnum):
    """How a kernel decodes a block: the arithmetic family of a format (one id per family, shared with C++)."""

    F16 = 0  # raw fp16 values
    Q4_SYM = 1  # 4-bit codes offset by 8, one fp16 scale (q4_0 family)
    Q4_ASYM = 2  # 4-bit codes, fp16 scale and min (q4_1 family)
    Q8 = 3  # int8 codes, one fp16 scale (q8_0)
    Q3_SYM = 4  # 3-bit codes offset by 4, one fp16 scale (q3_0)


@dataclass(frozen=True)
class BlockFormat:
    """A llama.cpp-style block format along the last dimension.

    Args:
        name: llama.cpp's name (`q4_0`, `q4_1`, `q8_0`, `f16`).
        kind: the arithmetic family (what kernels switch on).
        bits: bits per code.
        block_size: elements sharing one scale.
        scale_bytes: bytes of fp16 metadata per block (scale, and min for asymmetric formats).
        bytes_per_block: total bytes of one block, as llama.cpp lays it out.
    """

    name: str
    kind: Kind
    bits: int
    block_size: int
    scale_bytes: int
    bytes_per_block: int

    def __post_init__(self) -> None:
        code_bytes = self.bits * self.block_size // 8
        if code_bytes + self.scale_bytes != self.bytes_per_block:
            raise ValueError(
                f"format {self.name}: {self.block_size} codes of {self.bits} bits + {self.scale_bytes} scale bytes "
                f"is {code_bytes + self.scale_bytes} bytes, not the declared {self.bytes_per_block}"
            )

    @property
    def code_bytes(self) -> int:
        """Bytes of packed codes in one block."""
        return self.bits * self.block_size // 8

    @property
    def bits_per_element(self) -> float:
        """Nominal storage cost (ignores padding of a last dimension that is not a multiple of the block)."""
        return 8 * self.bytes_per_block / self.block_size


FORMATS: dict[str, BlockFormat] = {
    "q4_0": BlockFormat("q4_0", Kind.Q4_SYM, bits=4, block_size=32, scale_bytes=2, bytes_per_block=18),
    "q4_1": BlockFormat("q4_1", Kind.Q4_ASYM, bits=4, block_size=32, scale_bytes=4, bytes_per_block=20),
    "q8_0": BlockFormat("q8_0", Kind.Q8, bits=8, block_size=32, scale_bytes=2, bytes_per_block=34),
    "f16": BlockFormat("f16", Kind.F16, bits=16, block_size=1, scale_bytes=0, bytes_per_block=2),
    # Not in llama.cpp: the same arithmetic over blocks of 16, for a finer scale at +0.5 bit per element.
    "q4_0_16": BlockFormat("q4_0_16", Kind.Q4_SYM, bits=4, block_size=16, scale_bytes=2, bytes_per_block=10),
    "q4_1_16": BlockFormat("q4_1_16", Kind.Q4_ASYM, bits=4, block_size=16, scale_bytes=4, bytes_per_block=12),
    # Not in llama.cpp: q4_0's arithmetic with 3-bit codes (-4..3 times the scale), for values at 3.5 bits per element.
    # The 32 codes of a block take 12 bytes: 2 low bits each in bytes 0-7, the high bits in bytes 8-11 (`pack_3bit`).
    "q3_0": BlockFormat("q3_0", Kind.Q3_SYM, bits=3, block_size=32, scale_bytes=2, bytes_per_block=14),
}

# Symmetric formats whose encoder may search each block's scale (`quant.quantize`, `search_scale=True`).
SEARCHABLE_KINDS = (Kind.Q4_SYM, Kind.Q3_SYM)


def get_format(name: str) -> BlockFormat:
    """Look a format up by name, with an error naming the allowed ones."""
    if not isinstance(name, str) or name not in FORMATS:
        raise ValueError(f"unknown block format {name!r}; allowed: {sorted(FORMATS)}")
    return FORMATS[name]


def check_search_scale(name: str, search_scale: bool) -> BlockFormat:
    """The format `name`, with an error when a scale search is asked of a format without one."""
    fmt = get_format(name)
    if search_scale and fmt.kind not in SEARCHABLE_KINDS:
        raise ValueError(f"search_scale applies to the q4_0 family and q3_0, not {name!r}")
    return fmt

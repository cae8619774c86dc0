"""Stream codecs: how one tensor stream (keys or values) of a layer is encoded into packed storage."""

from .base import StreamCodec
from .basis import BasisCodec
from .channel import ChannelGroupCodec
from .delta import DeltaCodec
from .plain import PlainCodec
from .rotation import RotatedCodec

__all__ = ["BasisCodec", "ChannelGroupCodec", "DeltaCodec", "PlainCodec", "RotatedCodec", "StreamCodec"]

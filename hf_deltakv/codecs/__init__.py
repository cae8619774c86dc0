"""Stream codecs: how one tensor stream (keys or values) of a layer is encoded into packed storage."""

from .base import StreamCodec
from .channel import ChannelGroupCodec
from .delta import DeltaCodec
from .plain import PlainCodec
from .rotation import RotatedCodec

__all__ = ["ChannelGroupCodec", "DeltaCodec", "PlainCodec", "RotatedCodec", "StreamCodec"]

"""An out-of-tree platform that computes on the CPU and names no DeepSeek-V4 decoder block."""

from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import PlatformEnum


class RivalNPUPlatform(CpuPlatform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"

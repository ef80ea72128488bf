"""``FakeNPUPlatform``: an out-of-tree platform that computes on the CPU.

It reports ``PlatformEnum.OOT`` (so vLLM and the plugin take their out-of-tree paths: custom ops
dispatch to ``forward_oot``, ``vllm.models.deepseek_v4``'s ``__init__`` would pick the CUDA
modules) while tensors stay on the CPU, where this machine can run them. Like a vendor platform it
names its DeepSeek-V4 decoder block; it borrows vLLM's CPU block because that is the one whose
kernels run here.
"""

from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import PlatformEnum


class FakeNPUPlatform(CpuPlatform):
    _enum = PlatformEnum.OOT
    device_name = "cpu"  # out-of-tree platforms name their torch device here; tensors stay on the CPU
    deepseek_v4_decoder_layer = "vllm.models.deepseek_v4.cpu.model:DeepseekV4DecoderLayer"

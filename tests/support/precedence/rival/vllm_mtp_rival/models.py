"""The rival's drafters: vLLM's own V3 class under another name, and a V4 class never built here."""

from torch import nn
from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

constructed: list[str] = []


class RivalDeepSeekMTP(DeepSeekMTP):
    def __init__(self, *, vllm_config, prefix: str = ""):
        constructed.append(type(self).__name__)
        super().__init__(vllm_config=vllm_config, prefix=prefix)


class RivalDeepSeekV4MTP(nn.Module):
    def __init__(self, *, vllm_config, prefix: str = ""):
        raise NotImplementedError("the rival's V4 drafter is only resolved in these tests")

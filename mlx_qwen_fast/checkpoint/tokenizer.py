"""The checkpoints' tokenizer (:func:`make_tokenizer`): a byte-level BPE
trained on a small embedded English corpus, its special tokens and chat
template."""

import json
from pathlib import Path
from typing import Union

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 1280  # upper bound of the BPE trainer, specials included

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Pre-tokenizer regex of the Qwen3.5 tokenizer (transformers' Qwen3_5Tokenizer
# installs this one whatever tokenizer.json says, so use the same).
_QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)



# A small English corpus for the BPE trainer (original text).
_CORPUS = """\
The river starts as a thin line of water high in the hills, where snow melts
slowly in the spring. By the time it reaches the town it is wide and brown, and
it carries leaves, branches and the sound of the mountains with it. People have
lived along its banks for a very long time. They built mills to grind grain,
bridges to cross from one market to the other, and small boats to fish in the
quiet pools below the falls.

In the morning the baker opens the shop before the sun is up. She mixes flour,
water, salt and yeast, and she waits. Bread cannot be hurried; the dough must
rest and rise, and rest again. When the first loaves come out of the oven the
whole street smells of warm crust. Children on their way to school stop at the
window, and the old men who sit by the fountain buy a roll and share it with the
pigeons.

A computer does one small thing at a time, but it does billions of them every
second. A program is a list of instructions: load a number, add another number,
store the result, compare two values, jump to a different place if they are
equal. Out of these simple steps we build editors, games, maps of the stars and
models that write text. The hard part is not the machine. The hard part is to
say exactly what we mean.

Language models read text as tokens. A token can be a whole word, a piece of a
word, a single letter or a space. The model looks at the tokens it has seen so
far and gives a score to every token it knows. The highest score wins, or one is
drawn at random in proportion to the scores, and then the whole process starts
again with one more token. Long answers are made one token after another.

"What time is it?" asked the traveller.
"Almost seven," said the guard. "The last train left an hour ago. The next one
comes at six tomorrow morning, if the weather is good."
"Then I will wait," said the traveller, and she sat down on the bench with her
bag on her knees and a book in her hands.

Weather changes quickly near the sea. A clear blue sky can turn grey in ten
minutes, and a light breeze can become a strong wind that bends the trees and
throws salt spray over the walls of the harbour. Fishermen watch the clouds and
the birds. When the gulls fly inland and the water turns dark and flat, they
pull their boats up on the shore and tie them down.

Numbers are everywhere: 1, 2, 3, 10, 42, 100, 256, 1024, 2048 and 65536. A year
has 365 days, a day has 24 hours, and an hour has 60 minutes. If a train travels
at 80 kilometres per hour for 3 hours, it covers 240 kilometres. If a shop sells
12 eggs for 3 euros, each egg costs 25 cents.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

The garden behind the house is small, but it is full of life. There are beans
climbing up strings, tomatoes turning red in the late summer, and a row of herbs
by the kitchen door: mint, thyme, basil and parsley. Bees move from flower to
flower, and at night a hedgehog comes out from under the shed to look for
snails. Nobody planned it this way. It grew, a little more each year.

Good tools are simple to hold and hard to misuse. A sharp knife is safer than a
dull one, because it goes where you push it. A clear map is better than a long
list of directions. A test that fails loudly is better than one that passes
quietly when something is wrong. Measure first, then change one thing, then
measure again, and write down what you saw.

The library was quiet except for the turning of pages and the soft steps of the
librarian. Rows of shelves held books about history, science, music, cooking,
travel and the lives of people who had died long ago. A boy at the long table
was reading about volcanoes; a woman near the window was learning a new
language, repeating each word under her breath until it felt natural.
"""


def _train_tokenizer():
    """Train the byte-level BPE tokenizer (deterministic)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(
                add_prefix_space=False, trim_offsets=False, use_regex=False
            ),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    return tokenizer


def make_tokenizer(out_dir: Union[str, Path]) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` to ``out_dir``.

    A byte-level BPE (Qwen2/3 pre-tokenizer regex, NFC, byte-level decoder)
    trained with the ``tokenizers`` library on a small embedded English corpus:
    ~1.2K tokens, at most ``TOKENIZER_VOCAB_SIZE`` (1280), so every id is below
    the ``vocab_size`` of every preset (ids the model may emit beyond the
    tokenizer's vocabulary decode as "!" in mlx-lm's streaming detokenizer). Special tokens ``<|endoftext|>`` (id 0,
    also the pad token), ``<|im_start|>`` (1) and ``<|im_end|>`` (2, the eos
    token). Chat template: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
    message, ``<|im_start|>assistant\\n`` with ``add_generation_prompt``.
    The files are byte-identical on every call.

    Returns:
        ``Path(out_dir)``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out_dir / "tokenizer.json"))

    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(out_dir / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config, f, indent=2)

    generation_config = {
        "eos_token_id": [
            tokenizer.token_to_id("<|im_end|>"),
            tokenizer.token_to_id("<|endoftext|>"),
        ],
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
    }
    with open(out_dir / "generation_config.json", "w") as f:
        json.dump(generation_config, f, indent=2)
    return out_dir

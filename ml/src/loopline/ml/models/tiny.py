"""A tiny random Llama model with a ChatML tokenizer, built locally in seconds.

It stands in for a real model in tests and CI: transformers and vLLM both load it, and it is
big enough to memorise a few prompt->completion pairs.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loopline.common.atomic_files import replace_dir

# Written last into a finished model folder; a folder without it is an interrupted build.
COMPLETE_MARKER = ".loopline-complete"

SEED = 1234
VOCAB_SIZE = 1024
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Plain ChatML, as SmolLM2 uses (minus its default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Please write a short answer, then stop.",
    "Hello! How are you today? I am fine, thank you.",
    "A queue holds jobs; a worker takes one job at a time and reports the result.",
    "Training a model needs data, a loss, an optimizer and some patience.",
    "She said: \"Numbers like 3.14, 42 and 1,000 are common in text.\"",
    "Email me at user@example.com or visit https://example.org/docs (section 2).",
    "def add(a, b):\n    return a + b\n",
    "Lists: [1, 2, 3]; dicts: {'key': 'value'}; math: x = y * 2 - 1 / 4 % 5.",
]
_WORDS = (
    "the a an of to in on for with and or but not is are was were be been have has had do does "
    "did will would can could should may might must this that these those it its they them "
    "their we our you your he she his her i me my model token text data train test step loss "
    "learn answer question user assistant system prompt reply good bad new old first last "
    "small large fast slow time day year city country river mountain water fire earth air "
    "red green blue black white one two three four five six seven eight nine ten hundred"
).split()


def corpus() -> Iterator[str]:
    """Deterministic training text for the tokenizer: sentences, random word salad, numbers."""
    rng = random.Random(SEED)
    for _ in range(20):
        yield from _SENTENCES
    for _ in range(2000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        words[0] = words[0].capitalize()
        yield " ".join(words) + rng.choice([".", "?", "!", ",", ";", ":"])
    yield " ".join(str(n) for n in range(2000))
    yield "".join(chr(c) for c in range(32, 127))


def build_tokenizer():
    """Train a byte-level BPE on `corpus()` and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2 as in SmolLM2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=IM_START,
        eos_token=IM_END,
        # pad differs from eos so that training can mask padding without masking the real eos.
        pad_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def build_tiny_model(out_dir: Path) -> Path:
    """Build the tiny model into `out_dir` (replacing it) and return the folder.

    Deterministic: building twice gives byte-identical weights.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=True,
        # 0.3, not the usual 0.02: with tiny weights the logits are flat and nothing learns fast.
        initializer_range=0.3,
        max_position_embeddings=2048,
        bos_token_id=ids[IM_START],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[IM_START], eos_token_id=ids[IM_END], pad_token_id=ids[ENDOFTEXT]
    )
    with atomic_output_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_class(tmp)
    return out_dir


def portable_tokenizer_class(model_dir: Path) -> None:
    """Name the tokenizer class so that transformers 4.x (e.g. on a GPU host) loads it too.

    transformers 5 writes "TokenizersBackend", which 4.x does not know; "PreTrainedTokenizerFast"
    is the same class in 5.x and exists in 4.x.
    """
    path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # load-time arguments that leak into the file
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@contextmanager
def atomic_output_dir(out_dir: Path, replace: bool = True) -> Iterator[Path]:
    """Yield an empty temp dir next to `out_dir`; on success put it in place with a rename.

    Readers therefore see either no folder or a complete one, never a half-written model.
    The temp dir is a sibling so that the rename stays on one file system. With
    `replace=False` (caches) a complete `out_dir` that appeared meanwhile, e.g. from a
    concurrent build, is kept and this build is dropped.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        (tmp / COMPLETE_MARKER).write_text("complete\n")
        # mkdtemp makes the folder private (0700); model folders are shared read-only data.
        tmp.chmod(0o755)
        for f in tmp.rglob("*"):
            f.chmod(0o755 if f.is_dir() else 0o644)
        if out_dir.exists() and not replace and is_complete(out_dir):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_complete(model_dir: Path) -> bool:
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny Loopline test model.")
    parser.add_argument("--out", type=Path, required=True, help="output folder (replaced)")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.out))


if __name__ == "__main__":
    main()

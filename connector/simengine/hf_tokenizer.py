"""The sim-engine's tokenizer (`toy_tokenizer`) as Hugging Face tokenizer files.

A front that tokenizes in its own process (the gateway's `tokenizers` setting) loads a model's
tokenizer directory as vLLM does, with `transformers`. `write_tokenizer(directory)` writes the
sim-engine's byte-level tokenizer and chat template in that form, so that the dev stack and the
benchmarks exercise the same path a real model's tokenizer takes:

- byte ``b`` is id ``b + 3`` (a byte-level BPE with no merges), with ``<pad>``, ``<s>`` (BOS) and
  ``</s>`` (EOS) as ids 0, 1 and 2, and BOS added in front of a prompt when special tokens are;
- the chat template renders as `toy_tokenizer.render_chat` does, after ``<s>``, which vLLM's chat
  path (render, then tokenize without special tokens) turns into the BOS the sim-engine puts there.

One difference is left: a text holding the literal ``<pad>``, ``<s>`` or ``</s>`` tokenizes to that
special id here (as with a real model's tokenizer), and to its bytes in the sim-engine.

`kvplane sim-engine-tokenizer DIR` writes the files (`main`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvplane.connector.simengine.toy_tokenizer import BOS_ID, BYTE_OFFSET, EOS_ID, NUM_BYTE_IDS, PAD_ID

PAD, BOS, EOS = "<pad>", "<s>", "</s>"

# toy_tokenizer.render_chat, after BOS; a message's content is a string, or text parts joined as is.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(directory: str | Path) -> Path:
    """Writes the tokenizer's files (`tokenizer.json`, `tokenizer_config.json`, ...) into
    `directory`, created if missing; returns it."""
    # Imported here: only this command needs them (the sim-engine itself does not).
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()  # type: ignore[no-untyped-call]
    vocab = {PAD: PAD_ID, BOS: BOS_ID, EOS: EOS_ID}
    vocab.update({byte_chars[b]: b + BYTE_OFFSET for b in range(NUM_BYTE_IDS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # The whole text as one piece, mapped to its bytes' characters: each byte is one token.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, BOS, EOS)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvplane sim-engine-tokenizer",
        description="Write the sim-engine's tokenizer as Hugging Face files (for gateway.tokenizers).",
    )
    parser.add_argument("directory", help="where the files go (created if missing)")
    args = parser.parse_args(argv)
    try:
        path = write_tokenizer(args.directory)
    except ImportError as exc:
        print(f"kvplane sim-engine-tokenizer: needs transformers (tokenizer extra): {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0

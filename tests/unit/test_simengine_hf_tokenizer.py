"""The sim-engine's tokenizer written as Hugging Face files tokenizes as the sim-engine does, by
vLLM's procedure: a prompt with or without its BOS, and chat messages through the template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.connector.simengine import toy_tokenizer
from kvplane.connector.simengine.hf_tokenizer import main, write_tokenizer

# The special tokens' text is the one thing the two tokenize differently (the module says so).
_texts = st.text(max_size=200).filter(lambda t: "<s>" not in t and "</s>" not in t and "<pad>" not in t)
_contents = st.one_of(
    _texts,
    st.lists(_texts.map(lambda t: {"type": "text", "text": t}), max_size=3),
)
_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _contents}),
    min_size=1,
    max_size=4,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory = write_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


@settings(max_examples=200, deadline=None)
@given(text=_texts)
def test_a_prompt_has_the_sim_engines_ids_with_and_without_its_bos(tokenizer: Any, text: str) -> None:
    assert tokenizer.encode(text, add_special_tokens=True) == toy_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == toy_tokenizer.encode(text, add_bos=False)


@settings(max_examples=200, deadline=None)
@given(messages=_messages, generation=st.booleans())
def test_chat_messages_render_and_tokenize_as_the_sim_engine_does(
    tokenizer: Any, messages: list[dict[str, Any]], generation: bool
) -> None:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    expected = toy_tokenizer.encode(toy_tokenizer.render_chat(messages, add_generation_prompt=generation))
    # vLLM's chat path: render, then tokenize without adding special tokens (the BOS is rendered).
    assert tokenizer.encode(rendered, add_special_tokens=False) == expected


def test_the_command_writes_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "tok")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    assert loaded.decode(toy_tokenizer.encode("héllo", add_bos=False)) == "héllo"

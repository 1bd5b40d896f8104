"""LocalTokenizer against a tiny byte-level BPE tokenizer that the tests train themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from routing.hashing import chain_seed, prompt_chain
from routing.tokenize import InvalidMessages, LocalTokenizer, TokenizationError, build_tokenizer

SPECIAL = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message.role) }}"
    "{% endif %}"
    "<|{{ message.role }}|>{{ message.content }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "You are a helpful assistant. Answer briefly and cite your sources.",
    "The quick brown fox jumps over the lazy dog; then it naps in the sun.",
    "Retrieval-augmented generation feeds documents into long shared prompts.",
]
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Where does the fox nap?"},
]


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer with a BOS-adding post-processor, like Llama-style models."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos_id)]
    )
    return tokenizer


@pytest.fixture(scope="module")
def trained() -> Tokenizer:
    return train_tokenizer()


def write_model_dir(
    directory: Path, tokenizer: Tokenizer, chat_template: object = TEMPLATE, **config: object
) -> Path:
    tokenizer.save(str(directory / "tokenizer.json"))
    full_config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, **config}
    if chat_template is not None:
        full_config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(full_config))
    return directory


async def test_chat_is_the_rendered_template_tokenized_without_special_tokens(
    tmp_path: Path, trained: Tokenizer
) -> None:
    local = LocalTokenizer(write_model_dir(tmp_path, trained))
    text = local.render_chat(MESSAGES)
    assert text == (
        "<s><|system|>You are a helpful assistant.<|end|>\n"
        "<|user|>Where does the fox nap?<|end|>\n<|assistant|>"
    )
    prompt = await local.tokenize_chat("m", MESSAGES)
    assert prompt.token_ids == trained.encode(text, add_special_tokens=False).ids
    # The template writes BOS once; tokenizing must not add a second one.
    bos = trained.token_to_id("<s>")
    assert list(prompt.token_ids).count(bos) == 1 and prompt.token_ids[0] == bos
    without = await local.tokenize_chat("m", MESSAGES, add_generation_prompt=False)
    assert list(prompt.token_ids) == [*without.token_ids, trained.token_to_id("<|assistant|>")]


async def test_completion_adds_special_tokens(tmp_path: Path, trained: Tokenizer) -> None:
    local = LocalTokenizer(write_model_dir(tmp_path, trained))
    prompt = await local.tokenize_completion("m", "The quick brown fox")
    assert prompt.token_ids[0] == trained.token_to_id("<s>")
    assert prompt.token_ids == trained.encode("The quick brown fox").ids
    assert prompt.text is None


async def test_a_continued_conversation_keeps_its_block_prefix(
    tmp_path: Path, trained: Tokenizer
) -> None:
    local = LocalTokenizer(write_model_dir(tmp_path, trained))
    first = await local.tokenize_chat("m", MESSAGES, add_generation_prompt=False)
    follow_up = [
        *MESSAGES,
        {"role": "assistant", "content": "In the sun."},
        {"role": "user", "content": "And the dog?"},
    ]
    second = await local.tokenize_chat("m", follow_up)
    seed = chain_seed("m")
    first_chain = prompt_chain(first, 4, seed)
    assert len(first_chain) >= 3
    assert prompt_chain(second, 4, seed)[: len(first_chain)] == first_chain


async def test_long_prompts_tokenize_the_same_off_the_event_loop(
    tmp_path: Path, trained: Tokenizer
) -> None:
    local = LocalTokenizer(write_model_dir(tmp_path, trained))
    long_prompt = " ".join(CORPUS) * 200  # far above the offload threshold
    prompt = await local.tokenize_completion("m", long_prompt)
    assert prompt.token_ids == trained.encode(long_prompt).ids


@pytest.mark.parametrize(
    ("where", "expected_prefix"),
    [("argument", "ARG"), ("jinja_file", "FILE"), ("config_list", "LIST"), ("config", "<s>")],
)
async def test_chat_template_sources_and_precedence(
    tmp_path: Path, trained: Tokenizer, where: str, expected_prefix: str
) -> None:
    config_template: object = TEMPLATE
    if where == "config_list":
        config_template = [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "LIST{{ messages[0].content }}"},
        ]
    write_model_dir(tmp_path, trained, chat_template=config_template)
    if where == "jinja_file":
        (tmp_path / "chat_template.jinja").write_text("FILE{{ messages[0].content }}")
    override = "ARG{{ messages[0].content }}" if where == "argument" else None
    local = LocalTokenizer(tmp_path, chat_template=override)
    assert local.render_chat(MESSAGES).startswith(expected_prefix)


def test_template_helpers_behave_like_hugging_face(tmp_path: Path, trained: Tokenizer) -> None:
    template = (
        "{{ eos_token }}|{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    local = LocalTokenizer(write_model_dir(tmp_path, trained), chat_template=template)
    conversation = [{"role": "user", "content": "héllo"}, {"role": "user", "content": "x"}]
    text = local.render_chat(conversation)
    assert text == (
        '</s>|[{"role": "user", "content": "héllo"}, {"role": "user", "content": "x"}]|4|héllo'
    )


def test_content_parts_are_joined_as_text(tmp_path: Path, trained: Tokenizer) -> None:
    local = LocalTokenizer(write_model_dir(tmp_path, trained))
    parts = [
        {"type": "text", "text": "Where does"},
        {"type": "image_url", "image_url": {"url": "http://x/img.png"}},
        {"type": "text", "text": "the fox nap?"},
    ]
    assert local.render_chat([{"role": "user", "content": parts}]) == local.render_chat(
        [{"role": "user", "content": "Where does\nthe fox nap?"}]
    )


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (TEMPLATE, "unknown role tool"),  # the template's own raise_exception
        ("{{ messages.__class__.__mro__ }}", "unsafe"),  # the sandbox refuses internals
        ("{% set _ = messages.append(1) %}", "unsafe"),  # the sandbox is immutable
    ],
)
async def test_template_failures_are_tokenization_errors(
    tmp_path: Path, trained: Tokenizer, template: str, message: str
) -> None:
    local = LocalTokenizer(write_model_dir(tmp_path, trained), chat_template=template)
    with pytest.raises(TokenizationError, match=message):
        await local.tokenize_chat("m", [{"role": "tool", "content": "{}"}])


async def test_chat_without_a_template(tmp_path: Path, trained: Tokenizer) -> None:
    write_model_dir(tmp_path, trained, chat_template=None)
    with pytest.raises(TokenizationError, match="has no chat template"):
        await LocalTokenizer(tmp_path).tokenize_chat("m", MESSAGES)
    with pytest.raises(ValueError, match="no chat template found"):
        LocalTokenizer(tmp_path, require_chat_template=True)
    completion = await LocalTokenizer(tmp_path).tokenize_completion("m", "fox")
    assert completion.token_ids == trained.encode("fox").ids


async def test_content_parts_read_as_vllm_reads_them(tmp_path: Path, trained: Tokenizer) -> None:
    """vLLM takes plain-string parts and its other text part types, and skips a text part whose
    text is missing or null: routing tokenizes them to the same prompt as the plain text."""
    local = LocalTokenizer(write_model_dir(tmp_path, trained))
    plain = await local.tokenize_chat("m", [{"role": "user", "content": "hello\nworld"}])
    for parts in (
        ["hello", "world"],
        [{"type": "input_text", "text": "hello"}, {"type": "text"}, {"type": "output_text",
                                                                      "text": "world"}],
        [{"type": "text", "text": None}, "hello", {"type": "image_url", "image_url": {"url": "x"}},
         {"image_url": "http://x"}, {"type": "refusal", "refusal": "world"}],
    ):
        prompt = await local.tokenize_chat("m", [{"role": "user", "content": parts}])
        assert prompt.token_ids == plain.token_ids, parts


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must not be empty"),
        ("hello", "messages must be a list"),
        ([{"content": "x"}], r"messages\[0\]\.role must be a non-empty string"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": [5]}], r"content\[0\] must be a string or an object"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"content\[0\]\.text must"),
        (["user: hi"], r"messages\[0\] must be an object"),
    ],
)
async def test_malformed_messages_are_refused(
    tmp_path: Path, trained: Tokenizer, messages: object, message: str
) -> None:
    local = LocalTokenizer(write_model_dir(tmp_path, trained))
    with pytest.raises(InvalidMessages, match=message):
        await local.tokenize_chat("m", messages)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("no_tokenizer", "tokenizer.json does not exist"),
        ("bad_tokenizer", "cannot load"),
        ("bad_config", "cannot read"),
        ("list_without_default", "a list holding a template named 'default'"),
        ("bad_template", "chat template does not compile"),
    ],
)
def test_bad_model_directories_are_refused(
    tmp_path: Path, trained: Tokenizer, setup: str, message: str
) -> None:
    if setup != "no_tokenizer":
        write_model_dir(tmp_path, trained)
    if setup == "bad_tokenizer":
        (tmp_path / "tokenizer.json").write_text("{not json")
    elif setup == "bad_config":
        (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    elif setup == "list_without_default":
        write_model_dir(tmp_path, trained, chat_template=[{"name": "x", "template": "y"}])
    elif setup == "bad_template":
        write_model_dir(tmp_path, trained, chat_template="{% for %}")
    with pytest.raises(ValueError, match=message):
        LocalTokenizer(tmp_path)


async def test_prompt_must_be_text(tmp_path: Path, trained: Tokenizer) -> None:
    with pytest.raises(ValueError, match="prompt must be a string"):
        await LocalTokenizer(write_model_dir(tmp_path, trained)).tokenize_completion("m", [1])  # type: ignore[arg-type]


def test_factory_builds_a_local_tokenizer(tmp_path: Path, trained: Tokenizer) -> None:
    tokenizer = build_tokenizer("local", model_dir=write_model_dir(tmp_path, trained))
    assert isinstance(tokenizer, LocalTokenizer)

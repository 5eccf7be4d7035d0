"""Chat templates render as HF transformers' apply_chat_template renders them (the oracle), for
the fixture model's own template and for templates in the styles of popular models."""

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from common.errors import FailedPrecondition, InvalidArgument
from executor.tokenizer_files import TokenizerFiles
from gateway.chat import ChatTemplate
from tests.family_templates import FAMILY_TEMPLATES

CONVERSATION = [
    {"role": "system", "content": "You are terse. Réponds en français si besoin."},
    {"role": "user", "content": "  Hello there!  "},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Count: 1, 2, 3 — ünïcödé ✓"},
]

# In the styles of widely used models' templates (written here, not copied): header tokens,
# ChatML, alternation checked with raise_exception, loop controls, tojson, {% generation %}.
STYLES = {
    "headers": (
        "{{ bos_token }}{% for m in messages %}"
        "{{ '<|start|>' + m['role'] + '<|end_header|>\n\n' + m['content'] | trim + '<|eot|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant<|end_header|>\n\n' }}"
        "{% endif %}"),
    "chatml": (
        "{% for message in messages %}\n"
        "    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}\n    {{- '<|im_start|>assistant\n' }}\n{% endif %}\n"),
    "alternating": (
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
        "{% set rest = messages[1:] %}{% else %}{% set system = '' %}{% set rest = messages %}"
        "{% endif %}{{ bos_token }}"
        "{% for message in rest %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{% if message['role'] == 'user' %}"
        "{% if loop.first and system %}{{ '[INST] ' + system + '\n\n' + message['content'] + "
        "' [/INST]' }}{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
        "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"),
    "loops_and_json": (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m | tojson }}\n{% if loop.index > 10 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{% generation %}>>>{% endgeneration %}{% endif %}"),
}


@pytest.fixture(scope="module")
def hf_tokenizer(tiny):
    return AutoTokenizer.from_pretrained(tiny["model_dir"])


@pytest.fixture(scope="module")
def files(tiny):
    return TokenizerFiles.read(tiny["model_dir"])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_models_own_template_matches_transformers(hf_tokenizer, files,
                                                      add_generation_prompt):
    template = ChatTemplate(files.chat_template, files.special_tokens)
    text = template.render(CONVERSATION, add_generation_prompt=add_generation_prompt)
    expected = hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)
    assert text == expected
    ours = Tokenizer.from_str(files.tokenizer_json).encode(text, add_special_tokens=False).ids
    assert ours == hf_tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert ours[0] == hf_tokenizer.bos_token_id and ours.count(hf_tokenizer.bos_token_id) == 1


@pytest.mark.parametrize("style", sorted(STYLES))
def test_templates_in_popular_styles_match_transformers(hf_tokenizer, files, style):
    messages = CONVERSATION[1:] if style == "alternating" else CONVERSATION
    for system_first in ([CONVERSATION[0]] if style == "alternating" else [], []):
        conversation = system_first + messages
        hf_tokenizer.chat_template = STYLES[style]
        expected = hf_tokenizer.apply_chat_template(conversation, tokenize=False,
                                                    add_generation_prompt=True)
        text = ChatTemplate(STYLES[style], files.special_tokens).render(conversation)
        assert text == expected


@pytest.mark.parametrize("family", sorted(FAMILY_TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_served_families_templates_match_transformers(hf_tokenizer, files, family,
                                                          add_generation_prompt):
    """Gemma 2's, Gemma 3's and Phi-3's styles, with and without a system message (Gemma 2
    refuses one, as transformers does), and Gemma 3's content parts."""
    hf_tokenizer.chat_template = FAMILY_TEMPLATES[family]
    template = ChatTemplate(FAMILY_TEMPLATES[family], files.special_tokens)
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATION]
    for conversation in (CONVERSATION, CONVERSATION[1:], parts):
        if family == "gemma2" and conversation[0]["role"] == "system":
            with pytest.raises(InvalidArgument, match="System role not supported"):
                template.render(conversation)
            continue
        if conversation is parts and family != "gemma3_text":
            continue
        expected = hf_tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert template.render(conversation, add_generation_prompt) == expected


def test_a_template_that_refuses_the_messages_is_invalid_argument(files):
    template = ChatTemplate(files.chat_template, files.special_tokens)
    with pytest.raises(InvalidArgument, match="Unknown role: narrator"):
        template.render([{"role": "narrator", "content": "Once upon a time"}])
    with pytest.raises(InvalidArgument, match="alternate"):
        ChatTemplate(STYLES["alternating"], files.special_tokens).render(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_no_template_or_a_broken_one_is_failed_precondition(files):
    with pytest.raises(FailedPrecondition, match="no chat template"):
        ChatTemplate("", files.special_tokens).render(CONVERSATION)
    with pytest.raises(FailedPrecondition, match="does not compile"):
        ChatTemplate("{% for m in messages %}", files.special_tokens).render(CONVERSATION)


def test_tokenizer_files_read_named_templates_and_added_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": [{"name": "tool_use", "template": "T"}, '
        '{"name": "default", "template": "D"}], '
        '"bos_token": {"content": "<bos>", "lstrip": false}, "eos_token": "<eos>", '
        '"pad_token": null, "model_max_length": 8}')
    files = TokenizerFiles.read(tmp_path)
    assert files.chat_template == "D" and files.tokenizer_json == ""
    assert files.special_tokens == {"bos_token": "<bos>", "eos_token": "<eos>"}
    (tmp_path / "chat_template.jinja").write_text("J")  # the newer file wins, as in HF
    assert TokenizerFiles.read(tmp_path).chat_template == "J"


def test_a_multimodal_checkpoints_template_is_read_where_its_processor_keeps_it(tmp_path):
    """Gemma 3 4B+ folders often hold it only for their processor: processor_config.json's, else
    the legacy chat_template.json's (AutoProcessor's order), after the tokenizer's places."""
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    (tmp_path / "chat_template.json").write_text('{"chat_template": "P"}')
    assert TokenizerFiles.read(tmp_path).chat_template == "P"
    (tmp_path / "processor_config.json").write_text('{"chat_template": "Q", "image_seq_length": 4}')
    assert TokenizerFiles.read(tmp_path).chat_template == "Q"
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "T"}')
    assert TokenizerFiles.read(tmp_path).chat_template == "T"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert TokenizerFiles.read(tmp_path).chat_template == "J"


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "20 C, sunny", "tool_call_id": "call_1"},
]


def test_tools_render_as_transformers_renders_them(hf_tokenizer, files):
    """The tools reach the template as apply_chat_template(tools=...) gives them, with earlier
    calls and tool results (the fixture's template, in the Hermes / Qwen style)."""
    template = ChatTemplate(files.chat_template, files.special_tokens)
    text = template.render(TOOL_CONVERSATION, tools=TOOLS)
    assert text == hf_tokenizer.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS,  # (own)
                                                    chat_template=files.chat_template,
                                                    tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather", "description"' in text and "<tool_response>" in text
    assert template.render(CONVERSATION) == template.render(CONVERSATION, tools=None)


THINKING = (  # (Qwen3's way with enable_thinking, written here)
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}{{ bos_token }}")


def test_template_kwargs_reach_the_template_as_transformers_passes_them(hf_tokenizer, files):
    """vLLM's chat_template_kwargs: apply_chat_template(**kwargs), over the special tokens'
    names too."""
    hf_tokenizer.chat_template = THINKING
    template = ChatTemplate(THINKING, files.special_tokens)
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True},
                   {"bos_token": "<b>"}):
        expected = hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False,
                                                    add_generation_prompt=True, **kwargs)
        assert template.render(CONVERSATION, template_kwargs=kwargs) == expected
    assert "</think>" in template.render(CONVERSATION, template_kwargs={"enable_thinking": False})

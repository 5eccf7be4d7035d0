"""What an executor tells schedulers about its model's tokenizer, read from the model folder the
way HF transformers reads it: tokenizer.json, the chat template and the special tokens a template
may name (tokenizer_config.json's `*_token` entries).

The chat template is the tokenizer's, what AutoTokenizer's apply_chat_template renders:
chat_template.jinja, else tokenizer_config.json's `chat_template` (a string, or named templates of
which "default" is used). A multimodal checkpoint (Gemma 3 4B+) often keeps it only where its
processor reads it, which comes next in AutoProcessor's order: processor_config.json's
`chat_template`, else the legacy chat_template.json ({"chat_template": ...})."""

import dataclasses
import json
import logging
import pathlib

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenizerFiles:
    tokenizer_json: str = ""  # "": the model takes token ids only
    chat_template: str = ""  # "": no chat template
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def read(cls, model_dir: str | pathlib.Path) -> "TokenizerFiles":
        folder = pathlib.Path(model_dir)
        tokenizer = folder / "tokenizer.json"
        config = _json_object(folder / "tokenizer_config.json")
        return cls(tokenizer_json=tokenizer.read_text() if tokenizer.exists() else "",
                   chat_template=_chat_template(folder, config),
                   special_tokens=_special_tokens(config))


def _chat_template(folder: pathlib.Path, tokenizer_config: dict) -> str:
    """The first of the places the module docstring lists that holds a template; "" if none."""
    template_file = folder / "chat_template.jinja"
    if template_file.exists():
        return template_file.read_text()
    for config in (tokenizer_config, _json_object(folder / "processor_config.json"),
                   _json_object(folder / "chat_template.json")):
        template = _named_template(config.get("chat_template"))
        if template:
            return template
    return ""


def _json_object(path: pathlib.Path) -> dict:
    """A JSON object file of the folder ({} when absent)."""
    if not path.exists():
        return {}
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def _named_template(value) -> str:
    """tokenizer_config.json's chat_template: a template, or [{"name", "template"}, ...]."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template", "") for t in value if isinstance(t, dict)}
        if "default" not in named and named:
            log.warning("chat templates %s but none named 'default': no chat template",
                        sorted(map(str, named)))
        return named.get("default", "")
    return ""


def _special_tokens(config: dict) -> dict[str, str]:
    """bos_token, eos_token, ...: each a string, or an AddedToken's {"content": ...}."""
    tokens = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens

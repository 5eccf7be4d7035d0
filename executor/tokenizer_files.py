"""What an executor tells schedulers about its model's tokenizer, read from the model folder the
way HF transformers reads it: tokenizer.json, the chat template (chat_template.jinja, else
tokenizer_config.json's `chat_template`: a string, or named templates of which "default" is used)
and the special tokens a template may name (tokenizer_config.json's `*_token` entries)."""

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
        config = _tokenizer_config(folder / "tokenizer_config.json")
        template_file = folder / "chat_template.jinja"
        template = (template_file.read_text() if template_file.exists()
                    else _named_template(config.get("chat_template")))
        return cls(tokenizer_json=tokenizer.read_text() if tokenizer.exists() else "",
                   chat_template=template, special_tokens=_special_tokens(config))


def _tokenizer_config(path: pathlib.Path) -> dict:
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

"""Chat templates, rendered the way HF transformers' `apply_chat_template` renders them: a
sandboxed jinja2 environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text, the `{% generation %}` tag, and the model's
special tokens (bos_token, eos_token, ...) as variables. The rendered text already holds the
special tokens it needs: it is tokenized without adding any (add_special_tokens=False)."""

import datetime
import json

import jinja2
import jinja2.ext
import jinja2.sandbox

from common.errors import FailedPrecondition, InvalidArgument

ROLES = ("system", "developer", "user", "assistant", "tool")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: rendered as its body (HF marks the assistant's
    tokens with it, for training masks)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


class ChatTemplate:
    """A model's chat template, compiled once."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source  # the template's text (what tool-call format it uses)
        self._template, self._missing = None, "this model has no chat template"
        if source:
            try:
                self._template = _ENV.from_string(source)
            except jinja2.TemplateSyntaxError as err:
                self._missing = f"this model's chat template does not compile ({err})"
        self._special_tokens = dict(special_tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict] | None = None,
               template_kwargs: dict | None = None) -> str:
        """The prompt text for `messages` ([{"role", "content"}], content a string) and the
        `tools` the model may call ([{"type": "function", "function": {...}}], the template's
        `tools` variable, as transformers passes it), with `template_kwargs` as more variables
        (transformers' apply_chat_template(**kwargs), over the special tokens' names);
        INVALID_ARGUMENT when the template refuses them (its raise_exception), and
        FAILED_PRECONDITION when the model has no chat template."""
        if self._template is None:
            raise FailedPrecondition(f"{self._missing}: use /v1/completions with a prompt")
        try:
            text = self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self._special_tokens, **(template_kwargs or {})})
        except Exception as err:  # noqa: BLE001 - whatever the template made of these messages
            raise InvalidArgument(f"messages: the model's chat template refused them: "
                                  f"{type(err).__name__}: {err}") from None
        if continue_final_message:  # the reply goes on from the last message's own text
            last = messages[-1]["content"]
            end = text.rfind(last.strip()) if last.strip() else -1
            if end < 0:
                raise InvalidArgument("messages: continue_final_message needs the last "
                                      "message's text in the rendered prompt")
            text = text[:end + len(last.strip())]
        return text

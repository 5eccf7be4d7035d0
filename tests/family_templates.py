"""Chat templates in the style of the served families' own (written here, not copied): what
`loraplex up --model DIR` renders for a Gemma 2, Gemma 3 or Phi-3 folder, checked against
transformers' apply_chat_template (tests/gateway/test_chat_template.py, tests/e2e).

    gemma2  <bos><start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n; roles must
            alternate, a system message is refused (raise_exception)
    gemma3  as Gemma 2, a system message prefixed to the first user turn; content a string or
            a list of {"type": "text"} parts
    phi3    <|system|>\\n...<|end|>\\n<|user|>\\n...<|end|>\\n<|assistant|>\\n, eos at the end
            without a generation prompt
"""

# A tiny tokenizer's special tokens for each (bos, eos, then the template's markers)
GEMMA_TOKENS = ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")
PHI3_TOKENS = ("<s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>")

GEMMA2 = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")

GEMMA3 = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set turns = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set prefix = '' -%}\n"
    "    {%- set turns = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in turns -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception('Conversation roles must alternate user/assistant/...') }}\n"
    "    {%- endif -%}\n"
    "    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- else -%}\n"
    "        {%- for part in message['content'] -%}\n"
    "            {%- if part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}\n")

PHI3 = (
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|' + message['role'] + '|>' + '\\n' + message['content'] + '<|end|>' + '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")

FAMILY_TEMPLATES = {"gemma2": GEMMA2, "gemma3_text": GEMMA3, "phi3": PHI3}

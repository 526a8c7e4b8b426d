"""A byte-level BPE tokenizer with chat templates, and random conversations, made on the spot (no downloads).

The templates are ChatML as Qwen's tokenizers write it (`<|im_start|>role\\n...<|im_end|>\\n`, an assistant's
tool calls as `<tool_call>JSON</tool_call>`, tool results as "tool" turns): `CHATML`
without `{% generation %}` markers (jaxpar tells the assistant's tokens by rendering prefixes),
`CHATML_MARKED` with them (transformers' own assistant mask, the reference), and `REWRITES_LAST`, a
template that renders the last assistant turn unlike earlier ones (as templates that drop earlier
"thinking" do): not prefix-stable.
"""

from __future__ import annotations

import json
import os

import numpy as np

from tests.support.documents import WORDS

# A turn's body: its text, and an assistant's tool calls as JSON (Qwen's <tool_call> form).
_BODY = ("{{ message['content'] or '' }}{% if message.tool_calls is defined %}"
         "{{ '<tool_call>' + (message.tool_calls | tojson) + '</tool_call>' }}{% endif %}")
_TURN = "{{ '<|im_start|>' + message['role'] + '\\n' }}" + _BODY + "{{ '<|im_end|>' + '\\n' }}"
_PROMPT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
CHATML = "{% for message in messages %}" + _TURN + "{% endfor %}" + _PROMPT
CHATML_MARKED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}" + _BODY + "{{ '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{% else %}" + _TURN + "{% endif %}{% endfor %}" + _PROMPT
)
REWRITES_LAST = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\\n<think></think>' + message['content'] + '<|im_end|>\\n' }}"
    "{% else %}" + _TURN + "{% endif %}{% endfor %}" + _PROMPT
)
ROLE_WORDS = ("system", "user", "assistant", "be", "brief", "hi", "hello", "bye", "goodbye")


def make_chat_tokenizer(directory, template: str | None = CHATML, vocab_size: int = 320) -> str:
    """A byte-level BPE (GPT-2's pre-tokenizer, as Llama 3 and Qwen use) with ChatML's special
    tokens and `template` (None: no chat template), saved as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = np.random.default_rng(3)
    corpus = [" ".join(rng.choice(list(WORDS) + list(ROLE_WORDS), 12)) + "\n" for _ in range(300)]
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials[1:])
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(directory))
    return str(directory)


def sentence(rng, low: int = 1, high: int = 12) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(low, high + 1))))


def conversation(rng, turns: int, system: bool = False, high: int = 12) -> list[dict]:
    """`turns` user/assistant exchanges (a system prompt first if `system`)."""
    messages = [{"role": "system", "content": sentence(rng, 2, 6)}] if system else []
    for _ in range(turns):
        messages += [{"role": "user", "content": sentence(rng, 1, high)}, {"role": "assistant", "content": sentence(rng, 1, high)}]
    return messages


def tool_conversation(rng) -> list[dict]:
    """A user asks, the assistant calls a tool (no text), the tool answers, the assistant replies."""
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"query": sentence(rng, 1, 3)}}}
    return [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]


def conversations(count: int, seed: int = 0, max_turns: int = 3, high: int = 12) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    return [conversation(rng, int(rng.integers(1, max_turns + 1)), system=bool(rng.integers(0, 2)), high=high)
            for _ in range(count)]


def write_records(path, records: list[dict]) -> str:
    os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)

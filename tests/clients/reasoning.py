"""The `openai` Python client against a moe-node serving a model that thinks (the demo model
with a template that opens `<think>` in thinking mode): `reasoning_content` read off the
message and off streamed deltas as that client exposes fields it does not declare,
`reasoning_effort` as the client sends it, and the reasoning sent back in a second turn.
Usage: python3 reasoning.py http://127.0.0.1:PORT MODEL"""

import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
model = sys.argv[2]
question = [{"role": "user", "content": "What is 2 + 2?"}]
thinking = {"chat_template_kwargs": {"thinking": True}}

whole = client.chat.completions.create(model=model, messages=question, max_tokens=16,
                                       temperature=0, reasoning_effort="high",
                                       extra_body=thinking)
message = whole.choices[0].message
reasoning = message.model_extra["reasoning_content"]
assert isinstance(reasoning, str) and reasoning, message
assert whole.choices[0].finish_reason == "length", whole

stream = client.chat.completions.create(model=model, messages=question, max_tokens=16,
                                        temperature=0, stream=True, extra_body=thinking)
streamed, answer = "", ""
for chunk in stream:
    delta = chunk.choices[0].delta
    streamed += (delta.model_extra or {}).get("reasoning_content") or ""
    answer += delta.content or ""
assert streamed == reasoning, (streamed, reasoning)
assert answer == (message.content or ""), (answer, message.content)

# Chat mode: no reasoning.
plain = client.chat.completions.create(model=model, messages=question, max_tokens=8,
                                       temperature=0)
assert plain.choices[0].message.model_extra.get("reasoning_content") is None, plain
assert plain.choices[0].message.content, plain

# The first answer sent back with its reasoning: accepted, and the next turn answers.
turn = question + [{"role": "assistant", "content": message.content or "",
                    "reasoning_content": reasoning},
                   {"role": "user", "content": "And 3 + 3?"}]
again = client.chat.completions.create(model=model, messages=turn, max_tokens=4,
                                       temperature=0, extra_body=thinking)
assert again.choices[0].message.model_extra["reasoning_content"], again

# A bad value is a 400 the client raises as such.
try:
    client.chat.completions.create(model=model, messages=question, max_tokens=2,
                                   extra_body={"chat_template_kwargs": {"tools": []}})
    raise AssertionError("chat_template_kwargs naming `tools` was accepted")
except openai.BadRequestError as e:
    assert "cannot set `tools`" in str(e), e

print("reasoning: ok")

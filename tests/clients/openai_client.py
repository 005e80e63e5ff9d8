"""The `openai` Python client against a running moe-node (demo model): logprobs, n, echo,
the sampling controls through extra_body, structured output, tool calls (whole, streamed,
and sent back as a tool turn), and a 400 for an unknown field.
Usage: python3 openai_client.py http://127.0.0.1:PORT"""

import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
model = "demo-model"

# n with a seed: distinct choices, the same again; usage counts them all.
first = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=1.0,
                                  seed=3, n=3, logprobs=2, extra_body={"ignore_eos": True})
again = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=1.0,
                                  seed=3, n=3, logprobs=2, extra_body={"ignore_eos": True})
assert [c.index for c in first.choices] == [0, 1, 2], first
assert [c.text for c in first.choices] == [c.text for c in again.choices]
assert len({tuple(c.logprobs.tokens) for c in first.choices}) == 3, first.choices
assert first.usage.completion_tokens == 18, first.usage
for choice in first.choices:
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(value <= 0 for value in lp.token_logprobs)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)

# echo with max_tokens 0 scores the prompt (lm-eval's loglikelihood request).
scored = client.completions.create(model=model, prompt="Hi there", max_tokens=0, echo=True,
                                   logprobs=1, temperature=0)
choice = scored.choices[0]
assert choice.text == "Hi there", choice
assert choice.logprobs.token_logprobs[0] is None
assert all(value is not None and value <= 0 for value in choice.logprobs.token_logprobs[1:])

# Chat log probabilities.
chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
content = chat.choices[0].logprobs.content
assert len(content) == chat.usage.completion_tokens, chat
for entry in content:
    assert len(entry.top_logprobs) == 2
    assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-5
    assert isinstance(entry.bytes, list)

# Streamed chat with n: deltas per index.
texts = {}
stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=4, n=2, seed=1, temperature=1.0, stream=True)
for chunk in stream:
    for c in chunk.choices:
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
assert sorted(texts) == [0, 1], texts

# The sampling controls vLLM clients send through extra_body: top_k 1 is greedy.
greedy = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0)
top_k = client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=2.0,
                                  seed=9, extra_body={"top_k": 1})
assert greedy.choices[0].text == top_k.choices[0].text
biased = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                   logit_bias={"65": 100}, extra_body={"ignore_eos": True})
assert biased.choices[0].text == "AAA", biased

# Structured output: a JSON schema the reply validates against.
import json

schema = {"type": "object", "additionalProperties": False, "required": ["answer", "count"],
          "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 9}}}
reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "JSON please"}], max_tokens=300,
    temperature=0, response_format={"type": "json_schema",
                                    "json_schema": {"name": "answer", "schema": schema}})
answer = json.loads(reply.choices[0].message.content)
assert set(answer) == {"answer", "count"} and answer["answer"] in ("yes", "no"), answer
assert 0 <= answer["count"] <= 9, answer

# A forced tool call, whole and streamed; then the result sent back in a tool turn.
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}}}}}]
messages = [{"role": "user", "content": "Weather in Paris?"}]
choice = {"type": "function", "function": {"name": "get_weather"}}
called = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                        tool_choice=choice, max_tokens=300, temperature=0)
assert called.choices[0].finish_reason == "tool_calls", called
call = called.choices[0].message.tool_calls[0]
assert call.function.name == "get_weather", call
assert json.loads(call.function.arguments)["city"] in ("Paris", "Lima"), call
streamed = {}
for chunk in client.chat.completions.create(model=model, messages=messages, tools=tools,
                                            tool_choice=choice, max_tokens=300,
                                            temperature=0, stream=True):
    for delta_call in chunk.choices[0].delta.tool_calls or []:
        entry = streamed.setdefault(delta_call.index, {"name": "", "arguments": ""})
        entry["name"] += delta_call.function.name or ""
        entry["arguments"] += delta_call.function.arguments or ""
assert streamed == {0: {"name": "get_weather", "arguments": call.function.arguments}}, streamed
messages.append(called.choices[0].message.model_dump(exclude_none=True))
messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
after = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                       max_tokens=4, temperature=0)
assert after.choices[0].finish_reason in ("stop", "length", "tool_calls"), after

try:
    client.completions.create(model=model, prompt="x", extra_body={"max_token": 3})
    raise AssertionError("an unknown field was accepted")
except openai.BadRequestError as error:
    assert "max_token" in str(error), error

print("openai client: ok")

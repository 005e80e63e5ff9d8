"""A named tool call through the `openai` client on the demo model (random weights) finishes
with a valid call within the length its schema allows, whole and streamed, at temperature 0.8
for ten seeds, and so does `tool_choice: "required"` with two tools: the call's JSON is
compact, so a model that would draw whitespace forever cannot.
Prints the longest call in tokens. Usage: python3 tool_calls_finish.py http://127.0.0.1:PORT"""

import json
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
model = client.models.list().data[0].id
MAX_TOKENS = 128

# The OpenAI guide's get_weather, with the location a bounded name: a random model writes a
# free string until max_tokens whatever the grammar allows between tokens.
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["location", "unit"],
                   "properties": {"location": {"type": "string", "pattern": "^[A-Z][a-z]{2,11}$"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
choice = {"type": "function", "function": {"name": "get_weather"}}
# The longest call the schema allows, compact, in bytes (the demo vocabulary is bytes, so
# tokens are at most this): the longest location and unit, and the end token.
LONGEST_CALL = len('<tool_call>\n{"name":"get_weather","arguments":{"location":"') + 12 \
    + len('","unit":"fahrenheit"}}\n</tool_call>') + 1
assert LONGEST_CALL < MAX_TOKENS


def check(name, arguments):
    assert name == "get_weather", name
    parsed = json.loads(arguments)
    assert set(parsed) == {"location", "unit"}, parsed
    location = parsed["location"]
    assert 3 <= len(location) <= 12 and location.isascii() and location.istitle(), parsed
    assert parsed["unit"] in ("celsius", "fahrenheit"), parsed


longest = 0
for seed in range(10):
    whole = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                           tool_choice=choice, max_tokens=MAX_TOKENS,
                                           temperature=0.8, seed=seed)
    reply = whole.choices[0]
    assert reply.finish_reason == "tool_calls", (seed, whole)
    assert len(reply.message.tool_calls) == 1, (seed, whole)
    call = reply.message.tool_calls[0]
    check(call.function.name, call.function.arguments)
    assert whole.usage.completion_tokens <= LONGEST_CALL, (seed, whole.usage)
    longest = max(longest, whole.usage.completion_tokens)

    streamed, reasons = {}, []
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=tools,
                                                tool_choice=choice, max_tokens=MAX_TOKENS,
                                                temperature=0.8, seed=seed, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                reasons.append(c.finish_reason)
            for delta in c.delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert reasons == ["tool_calls"], (seed, reasons, streamed)
    assert list(streamed) == [0], (seed, streamed)
    check(streamed[0]["name"], streamed[0]["arguments"])
    # A seed draws the same tokens whole and streamed.
    assert streamed[0]["arguments"] == call.function.arguments, (seed, streamed, call)

# `required` with two tools: one call of either, as compact and as sure to close.
both = tools + [{"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}]
for seed in range(5):
    whole = client.chat.completions.create(model=model, messages=messages, tools=both,
                                           tool_choice="required", max_tokens=MAX_TOKENS,
                                           temperature=0.8, seed=seed)
    reply = whole.choices[0]
    assert reply.finish_reason == "tool_calls", (seed, whole)
    call = reply.message.tool_calls[0]
    if call.function.name == "get_time":
        assert json.loads(call.function.arguments) in ({"zone": "UTC"}, {"zone": "CET"}), call
    else:
        check(call.function.name, call.function.arguments)
    assert whole.usage.completion_tokens <= LONGEST_CALL, (seed, whole.usage)

print(f"tool calls: ok, longest {longest} tokens (at most {LONGEST_CALL}; max_tokens "
      f"{MAX_TOKENS})")

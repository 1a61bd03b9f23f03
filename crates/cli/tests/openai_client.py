"""Drives bgs serve's OpenAI-compatible API with the official `openai` package.

Usage: python3 openai_client.py BASE_URL   (e.g. http://127.0.0.1:8000/v1)
Prints "openai client: all checks passed" on success; raises on any mismatch.
"""
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused")

models = client.models.list()
model = models.data[0].id
assert len(models.data) == 1, models

# Non-streaming completion, run to its token limit.
r = client.completions.create(
    model=model, prompt="Hello", max_tokens=8, extra_body={"ignore_eos": True}
)
assert r.choices[0].finish_reason == "length", r
assert r.usage.completion_tokens == 8, r.usage
assert r.usage.total_tokens == r.usage.prompt_tokens + 8, r.usage
text = r.choices[0].text

# The same completion streamed gives the same text, then usage.
parts, usage, reasons = [], None, []
for chunk in client.completions.create(
    model=model,
    prompt="Hello",
    max_tokens=8,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"ignore_eos": True},
):
    if chunk.choices:
        parts.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    if chunk.usage:
        usage = chunk.usage
assert "".join(parts) == text, (parts, text)
assert reasons == ["length"], reasons
assert usage is not None and usage.completion_tokens == 8, usage

# Chat, streaming and not.
messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
c = client.chat.completions.create(
    model=model, messages=messages, max_tokens=6, extra_body={"ignore_eos": True}
)
assert c.choices[0].message.role == "assistant", c
assert c.usage.completion_tokens == 6, c.usage
streamed = ""
for chunk in client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=6,
    stream=True,
    extra_body={"ignore_eos": True},
):
    if chunk.choices and chunk.choices[0].delta.content:
        streamed += chunk.choices[0].delta.content
assert streamed == c.choices[0].message.content, (streamed, c.choices[0].message.content)

# Errors come back as the package's exceptions.
try:
    client.completions.create(model=model, prompt="x", max_tokens=0)
    raise AssertionError("max_tokens=0 was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400, e
try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404, e

print("openai client: all checks passed")

"""The official `openai` Python client against a simulated replica: completions and chat,
streaming and not, with usage."""

import openai
import pytest

from test_replica_launch import ReplicaProcess


@pytest.fixture(scope="module")
def client():
    with ReplicaProcess("--time-scale", "100", "--model", "sim/model", "--max-model-len", "8192") as r:
        yield openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["sim/model"]


def test_completion(client):
    c = client.completions.create(model="sim/model", prompt="Once upon a time", max_tokens=5)
    assert c.id.startswith("cmpl-")
    assert c.object == "text_completion"
    assert len(c.choices) == 1 and isinstance(c.choices[0].text, str)
    assert c.choices[0].finish_reason in ("length", "stop")
    assert 1 <= c.usage.completion_tokens <= 5
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens


def test_completion_token_prompts_and_batch(client):
    c = client.completions.create(model="sim/model", prompt=[[1, 2, 3], [4, 5, 6, 7]], max_tokens=2)
    assert sorted(ch.index for ch in c.choices) == [0, 1]
    assert c.usage.prompt_tokens == 7


def test_completion_stream(client):
    stream = client.completions.create(
        model="sim/model", prompt="Tell me", max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert 1 <= len(texts) <= 6
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1
    assert chunks[-1].usage.completion_tokens == len(texts)


def test_chat(client):
    c = client.chat.completions.create(
        model="sim/model",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
        ],
        max_tokens=4,
    )
    assert c.id.startswith("chatcmpl-")
    assert c.choices[0].message.role == "assistant"
    assert isinstance(c.choices[0].message.content, str)
    assert c.usage.prompt_tokens > 0
    assert c.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_with_tools(client):
    stream = client.chat.completions.create(
        model="sim/model",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[{"type": "function", "function": {"name": "weather", "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}],
        max_completion_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert isinstance(content, str)
    assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= 5


def test_errors_are_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="sim/model", prompt=list(range(10000)), max_tokens=5)
    assert "maximum context length" in str(e.value)

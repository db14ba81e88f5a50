"""The official `openai` and `anthropic` Python clients against a simulated replica: the
Responses API (JSON and streaming, multi-turn with previous_response_id and the store) and
Anthropic's Messages API (create, stream, count_tokens), as they would talk to vLLM."""

import anthropic
import openai
import pytest

from test_replica_launch import ReplicaProcess

LONG = (
    "The balancer routes each request to the replica that minimises the estimated time to "
    "first token, counting queueing and the prefill of the uncached part of its prompt. "
) * 12


@pytest.fixture(scope="module")
def replica():
    with ReplicaProcess(
        "--time-scale", "100", "--model", "sim/model", "--max-model-len", "8192", "--block-size", "16"
    ) as r:
        yield r


@pytest.fixture(scope="module")
def oai(replica):
    return openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def claude(replica):
    return anthropic.Anthropic(base_url=replica.url, api_key="sk-unused", max_retries=0, timeout=30)


def test_responses_create(oai):
    r = oai.responses.create(model="sim/model", input="Say hello.", instructions="Be brief.",
                             max_output_tokens=5)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete")
    assert r.model == "sim/model" and r.instructions == "Be brief."
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text and r.output_text == r.output[0].content[0].text
    assert 1 <= r.usage.output_tokens <= 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # Stored: retrieve gives it back; a finished response cannot be cancelled.
    again = oai.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.cancel(r.id)
    assert "Cannot cancel a synchronous response." in str(e.value)


def test_responses_stream(oai):
    stream = oai.responses.create(model="sim/model", input="Tell me a story.", max_output_tokens=6,
                                  stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert 1 <= len(deltas) <= 6
    final = events[-1].response
    assert final.id == events[0].response.id and final.id.startswith("resp_")
    assert final.output_text == "".join(deltas)
    assert final.usage.output_tokens == len(deltas)
    assert oai.responses.retrieve(final.id).output_text == final.output_text


def test_responses_stream_helper(oai):
    # Without max_output_tokens the answer ends complete (the helper wants response.completed).
    with oai.responses.stream(model="sim/model", input="Hi there.") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text and text


def test_responses_multi_turn_reuses_the_cached_prefix(oai):
    first = oai.responses.create(model="sim/model", input=LONG, instructions="Answer briefly.",
                                 max_output_tokens=4)
    second = oai.responses.create(model="sim/model", input="And why?", instructions="Answer briefly.",
                                  previous_response_id=first.id, max_output_tokens=4)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // 16 * 16 - 16, (cached, first.usage.input_tokens)
    # Streaming follow-ups continue the chain too.
    stream = oai.responses.create(model="sim/model", input="Thanks.", instructions="Answer briefly.",
                                  previous_response_id=second.id, max_output_tokens=3, stream=True)
    third = list(stream)[-1].response
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens // 16 * 16 - 16


def test_responses_unknown_previous_id_is_404(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model="sim/model", input="x", previous_response_id="resp_missing")
    assert e.value.status_code == 404
    assert e.value.body["message"] == "Response with id 'resp_missing' not found."
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_missing")


def test_messages_create(claude):
    m = claude.messages.create(model="sim/model", max_tokens=5, system="Be brief.",
                               messages=[{"role": "user", "content": "What is a KV cache?"}])
    assert m.type == "message" and m.role == "assistant" and m.model == "sim/model"
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= m.usage.output_tokens <= 5
    count = claude.messages.count_tokens(model="sim/model", system="Be brief.",
                                         messages=[{"role": "user", "content": "What is a KV cache?"}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count.input_tokens


def test_messages_stream_and_cache(claude):
    kwargs = dict(model="sim/model", max_tokens=6, system=LONG,
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Summarize."}]}])
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= final.usage.output_tokens <= 6
    again = claude.messages.create(**kwargs)
    total = claude.messages.count_tokens(model="sim/model", system=LONG, messages=kwargs["messages"]).input_tokens
    assert again.usage.cache_read_input_tokens >= total // 16 * 16 - 16
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


def test_messages_tools_round_trip(claude):
    tools = [{"name": "get_weather", "description": "The forecast.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    m = claude.messages.create(
        model="sim/model", max_tokens=4, tools=tools,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
        ],
    )
    assert m.content[0].type == "text"


def test_messages_errors_are_anthropic_errors(claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no/such-model", max_tokens=5,
                               messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="sim/model", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
